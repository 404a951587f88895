"""In-memory datasets (data/memory.py) and the prompts source over them: lazy reads,
epochs, seeking back, resuming a Hugging Face stream from its own state."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from hybridflow.data import memory
from hybridflow.data.prompts import epoch_order
from hybridflow.data.sources import load_records
from hybridflow.data.tasks import TASKS
from hybridflow.errors import ConfigError
from hybridflow.pipeline.sources.datasets import dataset_source
from hybridflow.pipeline.sources.prompt_source import PromptSource

RECS = TASKS["last_digit"].prompts(10, 0)
FIELDS = ("prompt_ids", "prompt_mask", "metadata_json", "sample_idx")


class CountingMap(Dataset):
    def __init__(self, records=RECS) -> None:
        self.records, self.seen = records, []

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        self.seen.append(i)
        return self.records[i]


class CountingStream(IterableDataset):
    def __init__(self, records=RECS) -> None:
        self.records, self.seen = records, []

    def __iter__(self):
        for i, r in enumerate(self.records):
            self.seen.append(i)
            yield r


def ids(records) -> list[int]:
    return [int(r["id"].rsplit("-", 1)[1]) for r in records]


def _hf_counting_map():
    """An HF map-style Dataset of RECS that records the rows it is asked for in `.seen`."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(RECS)
    seen: list[int] = []

    def counted(batch):
        seen.extend(int(i.rsplit("-", 1)[1]) for i in batch["id"])
        return batch

    ds.set_transform(counted)  # runs on each row read
    ds.seen = seen
    return ds


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_a_map_dataset_serves_the_same_batches_as_the_file_path(tmp_path, kind):
    """The same records as a torch (or Hugging Face) Dataset and as a .jsonl file:
    identical batches at every step (the eager path's order, metadata and padding), rows
    read only on demand. (The HF one is also what test_api_datasets.py's engine runs
    would read: the same MapRecords path as the torch one.)"""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    ds = CountingMap() if kind == "torch" else _hf_counting_map()
    opts = {"tokenizer": "builtin"}
    lazy = PromptSource(FIELDS, {**opts, "source": dataset_source(ds, tmp_path)}, seed=5)
    eager = PromptSource(FIELDS, {**opts, "source": str(path)}, seed=5)
    assert ds.seen == []  # building the source (as validation does) reads nothing
    for step in range(4):  # 12 rows: crosses into epoch 1
        a, b = lazy.batch(step, 3), eager.batch(step, 3)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    order = epoch_order(10, 5, 0) + epoch_order(10, 5, 1)
    assert ds.seen == order[:12]
    assert dataset_source(ds, tmp_path) == dataset_source(ds, tmp_path)  # one handle


def test_a_stream_is_read_only_as_far_as_asked_and_wraps_into_epochs():
    ds = CountingStream()
    recs = memory.lookup(dataset_source(ds, None), "x")
    assert isinstance(recs, memory.StreamRecords)
    assert ids(recs.read(0, 4)) == [0, 1, 2, 3] and ds.seen == [0, 1, 2, 3]
    assert ids(recs.read(4, 4)) == [4, 5, 6, 7] and ds.seen == list(range(8))
    assert ids(recs.read(8, 4)) == [8, 9, 0, 1] and recs.epoch == 1  # epoch 1 restarts it
    # Behind the cursor (a resume to an earlier step): restart and skip, k reads.
    reads = recs.reads
    assert ids(recs.read(2, 2)) == [2, 3]
    assert recs.reads - reads == 4 and recs.epoch == 0


def test_bad_datasets_fail_with_the_key_and_a_fix():
    class NoLen(Dataset):
        def __getitem__(self, i):
            return {}

    with pytest.raises(ConfigError, match="without __len__"):
        dataset_source(NoLen(), None)
    with pytest.raises(ConfigError, match="is empty"):
        dataset_source(CountingMap([]), None)

    class Once(IterableDataset):  # an iterator that cannot be read twice
        def __init__(self) -> None:
            self.it = iter([{"prompt": "a"}])

        def __iter__(self):
            return self.it

    recs = memory.lookup(dataset_source(Once(), None), "x")
    with pytest.raises(ConfigError, match="yielded no record in epoch 1"):
        recs.read(0, 2)
    recs = memory.lookup(dataset_source(CountingMap([{"prompt": "a"}, 2]), None), "x")
    assert isinstance(recs, memory.MapRecords) and recs.record(0) == {"prompt": "a"}
    with pytest.raises(ConfigError, match=r"record 1.*must be a dict"):
        recs.record(1)
    with pytest.raises(ConfigError, match=r"write the records to a \.jsonl"):
        memory.lookup("memory:999999", "data.options.source")
    with pytest.raises(ConfigError, match=r"prompts source of Engine\.train"):
        load_records(dataset_source(CountingMap(), None))
    with pytest.raises(ConfigError, match="Hugging Face Dataset"):
        dataset_source(object(), None)


def test_tensor_values_become_json_metadata(tmp_path):
    ds = CountingMap([{"prompt": "last:12=", "answer": torch.tensor(2)}])
    src = PromptSource(FIELDS, {"tokenizer": "builtin", "source": dataset_source(ds, None)}, 0)
    from hybridflow.data.batching import decode_metadata

    assert decode_metadata(src.batch(0, 1)["metadata_json"]) == [{"answer": 2, "index": 0}]


def test_hf_datasets_map_and_stream_resume_from_their_own_state():
    datasets = pytest.importorskip("datasets")
    seen: list[int] = []

    def count(ex):
        seen.append(int(ex["id"].rsplit("-", 1)[1]))
        return ex

    def stream(shuffled: bool):
        base = datasets.Dataset.from_list(RECS).to_iterable_dataset(num_shards=2)
        return (base.shuffle(seed=3, buffer_size=4) if shuffled else base).map(count)

    hf_map = datasets.Dataset.from_list(RECS)
    assert memory.kind_of(hf_map) == "map"
    with pytest.raises(ConfigError, match="several splits"):
        memory.kind_of(datasets.DatasetDict({"train": hf_map}))

    for shuffled in (False, True):
        # The uninterrupted reference: 3 epochs (a shuffled one reorders per epoch).
        whole = memory.lookup(dataset_source(stream(shuffled), None), "x")
        ref = [ids(whole.read(k, 5)) for k in range(0, 30, 5)]
        assert sorted(ref[0] + ref[1]) == list(range(10))
        assert (ref[0] + ref[1] != ref[2] + ref[3]) == shuffled

        # A run stopped after 3 batches; a fresh object (as in a new process) resumes
        # at record 15, mid epoch 1: from the stream's own state, reading nothing
        # before record 15, or (shuffle buffer: HF restores it empty) by counting.
        run = memory.lookup(dataset_source(stream(shuffled), None), "x")
        assert isinstance(run, memory.StreamRecords)
        for k in range(0, 15, 5):
            run.read(k, 5)
        snap = run.state_at(15)
        fresh = memory.lookup(dataset_source(stream(shuffled), None), "x")
        assert isinstance(fresh, memory.StreamRecords)
        if shuffled:
            assert snap is None and not fresh.exact_state
        else:
            assert snap is not None and snap["epoch"] == 1
            fresh.restore(15, json.loads(json.dumps(snap)))  # as written to a checkpoint
        seen.clear()
        assert [ids(fresh.read(k, 5)) for k in range(15, 30, 5)] == ref[3:]
        assert len(seen) == fresh.reads == (30 if shuffled else 15)
