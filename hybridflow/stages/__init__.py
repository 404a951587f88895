"""Role implementations (one module per role) and the backend registry.

The registry maps (role kind, backend) to a class path; classes are imported only in the
stage process that needs them, so the coordinator never imports transformers or vLLM.
"""

from hybridflow.stages.base import BACKENDS, Role, StageContext, create_role, register

register("*", "synthetic", "hybridflow.stages.synthetic:SyntheticRole")
register("rollout", "hf", "hybridflow.stages.rollout_hf:HFRollout")
register("rollout", "vllm", "hybridflow.stages.rollout_vllm:VLLMRollout")
register("actor", "hf", "hybridflow.stages.actor:Actor")
register("critic", "hf", "hybridflow.stages.critic:Critic")
register("reference", "hf", "hybridflow.stages.reference:Reference")
register("reward", "function", "hybridflow.stages.reward.function:FunctionReward")
register("reward", "model", "hybridflow.stages.reward.model:ModelReward")
register("reward", "http", "hybridflow.stages.reward.service:HttpReward")
register("reward", "zmq", "hybridflow.stages.reward.service:ZmqReward")

__all__ = ["BACKENDS", "Role", "StageContext", "create_role", "register"]
