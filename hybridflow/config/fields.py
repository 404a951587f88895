"""The names of the per-sample values the built-in ops, data sources and the runtime
exchange: THE table of them (a topology's `data.fields` and each op's `inputs:` /
`outputs:` name these; so do the step-logic compiler, the roles and the samples file).

Every model-backed role sees one sequence layout (stages/common.py):

    prompt_ids     [B, P] int64  left-padded        prompt_mask    [B, P] 0/1
    response_ids   [B, R] int64  right-padded       response_mask  [B, R] 0/1

A module that needs one of these names imports it from here (or a tuple built here)
instead of writing the string list again; `FIELDS` is every name the built-in ops and
sources use, with its shape, so a check such as "this name is the runtime's" reads it.
Invariant: this module imports nothing (it sits in the lowest config layer, torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    shape: str  # e.g. "[B, R] float32"
    doc: str  # one line


FIELDS: dict[str, Field] = {
    # The data source's
    "prompt_ids": Field("[B, P] int64", "prompt tokens, left-padded"),
    "prompt_mask": Field("[B, P] 0/1", "1 at prompt tokens"),
    "metadata_json": Field("[B, L] uint8", "the dataset record as JSON bytes"),
    "sample_idx": Field("[B] int64", "global sample number: step * B + row"),
    "group_index": Field("[B] int64", "the prompt a sample answers (a GRPO group)"),
    # The rollout's
    "response_ids": Field("[B, R] int64", "sampled tokens, right-padded"),
    "response_mask": Field("[B, R] 0/1", "1 at model tokens (0: observation or padding)"),
    "rollout_logprobs": Field("[B, R] float32", "the sampler's log-probs of its tokens"),
    "env_reward": Field("[B] float32", "a multi-turn environment's reward"),
    "num_turns": Field("[B] int64", "turns of a multi-turn trajectory"),
    # Scoring and training
    "rewards": Field("[B] float32", "one reward per sample"),
    "reward_info": Field("[B, L] uint8", "the scorer's extras as JSON bytes"),
    "old_logprobs": Field("[B, R] float32", "the actor's log-probs before the update"),
    "ref_logprobs": Field("[B, R] float32", "the reference model's log-probs"),
    "values": Field("[B, R] float32", "the critic's values"),
    "advantages": Field("[B, R] float32", "advantages (0 at padding)"),
    "returns": Field("[B, R] float32", "return targets of the critic"),
    "sample_mask": Field("[B] float32", "dynamic sampling: 1 = row kept for the loss"),
}

PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
RESPONSE_FIELDS = ("response_ids", "response_mask")
# What every model-backed role reads: prompt and response, ids and masks.
SEQUENCE_FIELDS = PROMPT_FIELDS + RESPONSE_FIELDS
# The rollout's generate: prompts in, responses and the sampler's log-probs out.
GENERATE_INPUTS = PROMPT_FIELDS
GENERATE_OUTPUTS = (*RESPONSE_FIELDS, "rollout_logprobs")
# A data source's record of each row (the reward's ground truth, the environment's task).
METADATA = "metadata_json"
# A data source's numbering of each row: the sample, and the prompt it answers.
SAMPLE_INDEX = "sample_idx"
GROUP_INDEX = "group_index"
