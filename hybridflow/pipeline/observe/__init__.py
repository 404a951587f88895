"""Observability: metrics sinks (jsonl, TensorBoard, wandb, mlflow), the console, the reward
plot."""
