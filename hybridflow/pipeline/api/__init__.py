"""The public Python API: `DataflowBuilder` (builder.py) declares a job; `build()` freezes
the declarations (declared.py) into a `Job` of plain data (job.py) that the `Engine`
(engine.py) runs; results.py shapes what its calls return; placement.py maps device
mappings to processes."""
