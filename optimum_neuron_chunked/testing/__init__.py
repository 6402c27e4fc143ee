"""Tiny random checkpoints and harnesses for tests, the demo and benchmarks; not needed to serve.

checkpoints.py   small random checkpoints of each supported family, built locally (no hub)
reference.py     HF transformers' greedy continuation, the reference our exports must match
server.py        `vllm serve` in its own process group on a free local port
export_cache.py  the hash of the code that shapes compiled graphs, which keys cached exports
"""
