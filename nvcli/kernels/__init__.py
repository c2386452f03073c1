"""Attention and KV-cache kernels: Triton on CUDA, pure-torch references elsewhere.

`ops.py` picks the implementation from the tensors' device; every Triton kernel has its
reference in `reference.py`, which the CPU path and the tests use.
"""
