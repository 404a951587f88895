"""Built-in environments: `calculator` (a tool for word problems, gsm8k reward),
`guess_number` (a multi-turn game rewarded at the end) and `python` (a `python(code)`
tool running model-written code in a separate, limited process: python_exec.py says
exactly what it isolates). Named in config by these short names
(hybridflow.stages.env.registry.BUILTIN_ENVS); importing this package imports none of
the modules."""
