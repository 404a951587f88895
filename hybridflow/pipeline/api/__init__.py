"""The public Python API: `DataflowBuilder` (builder), `Engine` (engine), device placement."""
