"""One model over several devices: the ranks of a trainable role (FSDP2).

A trainable role (actor, critic) mapped to N devices runs as N stage replicas that are the
N ranks of one process group; the model is sharded with PyTorch FSDP2 (`fully_shard`, one
unit per transformer layer, then the root). The coordinator sends every task of such a
role to all ranks, each with its share of the rows (pipeline/runtime/scheduler.py), so
the ranks run the same collectives in the same order and one optimizer step of the group
is one RL step.

  options.py     the `fsdp*` options every shardable role accepts, and the plan-time rule
                 deciding when a role's replicas are ranks (`sharded`)
  group.py       joining the group from the rendezvous the launcher handed the replicas
                 (NCCL on GPU, gloo on CPU), and the few collectives the trainer needs
  fsdp.py        wrapping a transformers model, gathering full weights bucket by bucket
  checkpoint.py  sharded checkpoints with torch.distributed.checkpoint (safetensors files,
                 JSON metadata: nothing pickled), loadable on any number of ranks
"""
