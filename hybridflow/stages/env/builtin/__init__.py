"""Built-in environments: `calculator` (a tool for word problems, gsm8k reward) and
`guess_number` (a multi-turn game rewarded at the end). Named in config by these short
names (hybridflow.stages.env.registry.BUILTIN_ENVS); importing this package imports
neither module."""
