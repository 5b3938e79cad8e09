"""Load generation against running specdec servers (or any OpenAI-compatible one on loopback).

Streams chat completions of Spec-Bench prompts under a concurrency sweep (closed
loop) or an arrival-rate sweep (open loop, Poisson), and reports TTFT,
inter-token latency, end-to-end latency, output tokens/s and errors per target
and level. Usage: `python -m loadtest --help`; docs/LOADTEST.md.
"""
