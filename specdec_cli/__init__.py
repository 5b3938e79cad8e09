"""The `specdec` command, above everything it runs: the server (serve), the tools (bench, calibrate,
train) and the runtime (pull, models, plan, generate). Each command imports its layer when it runs, so
`specdec serve` never loads the tools."""
