"""The native engine's forward passes over a transformers model's own modules.

model.NativeModel   prefill / extend / decode over the slot KV cache
fused.FusedDecode   the decode step in few kernels (merged projections, compiled parts)
"""
