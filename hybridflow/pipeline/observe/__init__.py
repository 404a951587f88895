"""Observability: metrics sinks (jsonl, TensorBoard), the console, the reward plot."""
