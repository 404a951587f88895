"""Datasets given to the Python API as objects: a torch Dataset / IterableDataset and a
Hugging Face Dataset / streaming IterableDataset, built locally (nothing downloaded).

Each trains 2 steps with a tiny model, then one more in the same engine, then a fresh
engine on a fresh copy of the dataset (as a restarted process would have) resumes from
the checkpoint after step 2: it must train on the same records as the first engine's
third step. Counting datasets check that a stream is read only as far as the steps
needed and a map-style dataset only at the rows they needed.

A Hugging Face map-style Dataset is not run here: it is the same "map" kind as a torch
Dataset (data/memory.py: MapRecords, row i by `obj[i]`), so the engine path is the torch
one's; that it is read lazily and batches as the file path does is checked without
processes in tests/data/test_data_memory.py. The two streams differ (an HF stream
resumes from its own saved state): both run.
"""

from __future__ import annotations

import json

import pytest
from torch.utils.data import Dataset, IterableDataset

from hybridflow import DataflowBuilder
from hybridflow.data.prompts import epoch_order
from hybridflow.data.tasks import TASKS

SEED = 4
N = 10  # records; a step holds 2 prompts (step_batch 4, n = 2)
RECS = TASKS["last_digit"].prompts(N, 0)
LOGIC = """
response = actor.generate(prompt, n=2)
reward_score = reward.score(prompt, response)
loss = grpo_loss(reward_score)
actor.update(loss)
"""


def builder() -> DataflowBuilder:
    df = DataflowBuilder("datasets", seed=SEED)
    df.add_actor("tiny", device_mapping="cpu", lr=1e-2, max_new_tokens=3)
    # The reward beside the actor: one stage process per engine start (placement is not
    # what these tests are about; tests/api/test_api_engine*.py run a separate one).
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu")
    df.define_training_step(["prompt"], ["loss"], LOGIC)
    df.configure(step_batch=4, micro_batch=2)
    return df


def number(rec) -> int:
    return int(rec["id"].rsplit("-", 1)[1])


class CountingMap(Dataset):
    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        self.seen.append(i)
        return RECS[i]


class CountingStream(IterableDataset):
    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def __iter__(self):
        for rec in RECS:
            self.seen.append(number(rec))
            yield rec


def make(kind: str, seen: list[int]):
    """A dataset of RECS whose reads append the record's number to `seen`."""
    if kind == "torch-map":
        return CountingMap(seen)
    if kind == "torch-stream":
        return CountingStream(seen)
    datasets = pytest.importorskip("datasets")
    if kind == "hf-map":
        ds = datasets.Dataset.from_list(RECS)

        def counted(batch):
            seen.extend(int(i.rsplit("-", 1)[1]) for i in batch["id"])
            return batch

        ds.set_transform(counted)  # runs on each row read
        return ds

    def count(rec):
        seen.append(number(rec))
        return rec

    return datasets.Dataset.from_list(RECS).to_iterable_dataset(num_shards=2).map(count)


@pytest.mark.parametrize("kind", ["torch-map", "torch-stream", "hf-stream"])
def test_dataset_objects_train_lazily_and_resume_at_the_same_record(kind, tmp_path):
    stream = kind.endswith("stream")
    # The rows of prompts 0..5 (steps 0, 1, 2): a map-style dataset in the seeded epoch
    # order of the eager sources, a stream in its own order.
    rows = list(range(6)) if stream else epoch_order(N, SEED, 0)[:6]
    seen: list[int] = []
    ds = make(kind, seen)
    ck = tmp_path / "ck"
    with builder().build(metrics_backend="null", log_dir=tmp_path / "a") as engine:
        engine.save_checkpoint(ck, save_interval=1, keep_last=5)
        first = engine.train(ds, steps=2)
        assert [m["step"] for m in first.metrics] == [0, 1]
        assert seen == rows[:4]  # read only as far as 2 steps needed: nothing written out
        engine.train(ds, steps=1)  # the same process reads on: nothing read again
        assert seen == rows[:6]
    assert not list((tmp_path / "a").glob("prompts-*.jsonl"))
    has_state = (ck / "step-00000002" / "data-stream.json").is_file()
    assert has_state == (kind == "hf-stream")  # an HF stream's own position

    # A fresh engine and a fresh copy of the dataset, as after a restart, resumed from
    # the checkpoint after step 2: its first step trains on prompts 4 and 5 again.
    seen2: list[int] = []
    with builder().build(metrics_backend="null", log_dir=tmp_path / "b") as engine:
        engine.save_checkpoint(ck, save_interval=0, keep_last=5)
        engine.resume(ck / "step-00000002")
        resumed = engine.train(make(kind, seen2), steps=1)
    assert [m["step"] for m in resumed.metrics] == [2]
    if kind == "torch-stream":
        assert seen2 == list(range(6))  # the cost of a resume: records 0..3 read, dropped
    else:  # by index, or from the HF stream's saved state: nothing before them read
        assert seen2 == rows[4:6]
    meta = json.loads((ck / "step-00000003" / "meta.json").read_text())
    assert meta["data"]["next_step"] == 3
