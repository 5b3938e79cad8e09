"""The tools above the runtime: the bench, training, calibration and the quantization benchmarks.

They compose `specdec_core` and measure or train what it serves; nothing in the core imports them, and
`specdec serve` runs without them (their dependencies, matplotlib and scipy, are the `tools` extra).
"""
