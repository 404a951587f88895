"""Rollout backends, one module (or package) each, all speaking one contract (state.py):
`hf` (transformers generate, the reference), `vllm` (for users who have vLLM), `native`
(the project's own continuous-batching engine). No backend imports another.
"""
