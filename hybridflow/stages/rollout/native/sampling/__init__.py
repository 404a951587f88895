"""Sampling for the native engine: the torch sampler (sampler.py, the reference and the
top-k/top-p path) and its Triton kernels for untruncated steps (kernel.py)."""
