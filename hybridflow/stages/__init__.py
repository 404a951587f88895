"""Role implementations (one module per role) and the backend registry.

The registry maps (role kind, backend) to a class path. The coordinator imports a backend's
module only to check its `options_cls` at plan time; models and engines (transformers,
vLLM) are built in `setup`, in the stage process that needs them.
"""

from hybridflow.stages.base import BACKENDS, Role, StageContext, create_role, register

register("*", "synthetic", "hybridflow.stages.synthetic:SyntheticRole")
register("rollout", "hf", "hybridflow.stages.rollout.hf:HFRollout")
register("rollout", "vllm", "hybridflow.stages.rollout.vllm:VLLMRollout")
register("rollout", "native", "hybridflow.stages.rollout.native.role:NativeRollout")
register("actor", "hf", "hybridflow.stages.actor:Actor")
register("critic", "hf", "hybridflow.stages.critic:Critic")
register("reference", "hf", "hybridflow.stages.reference:Reference")
register("reward", "function", "hybridflow.stages.reward.function:FunctionReward")
register("reward", "model", "hybridflow.stages.reward.model:ModelReward")
register("reward", "http", "hybridflow.stages.reward.service:HttpReward")
register("reward", "zmq", "hybridflow.stages.reward.service:ZmqReward")
register("reward", "env", "hybridflow.stages.reward.env:EnvReward")

__all__ = ["BACKENDS", "Role", "StageContext", "create_role", "register"]
