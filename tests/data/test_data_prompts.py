"""Prompt sources (jsonl / json / parquet / datasets dir / task), datasets, batching."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data import (
    DataOptions,
    PromptDataset,
    PromptStream,
    collate_prompts,
    collate_sft,
    decode_metadata,
    encode_metadata,
    load_records,
)
from hybridflow.errors import ConfigError
from hybridflow.models import builtin_tokenizer

ROWS = [
    {"prompt": "last:123=", "answer": "3", "id": "a"},
    {"prompt": "copy:47=", "answer": "47", "id": "b"},
    {"prompt": "parity:1=", "answer": "odd", "id": "c"},
]


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_and_json_sources(tmp_path):
    assert load_records(str(_write_jsonl(tmp_path / "p.jsonl", ROWS))) == ROWS
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    assert load_records(str(tmp_path / "p.json")) == ROWS
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON") as exc:
        load_records(str(bad), path="data.source")
    assert exc.value.path == "data.source"
    with pytest.raises(ConfigError, match="no dataset at"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="unknown format"):
        load_records(str(_write_jsonl(tmp_path / "p.csv", ROWS)))
    with pytest.raises(ConfigError, match="unknown built-in task"):
        load_records("task:nope")
    assert len(load_records("task:copy", size=7, seed=3)) == 7


def test_parquet_and_datasets_directory(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "p.parquet")
    assert load_records(str(tmp_path / "p.parquet")) == ROWS
    # The `datasets.save_to_disk` layout: Arrow IPC stream files listed in state.json.
    d = tmp_path / "ds" / "train"
    d.mkdir(parents=True)
    with (
        pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    (d / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (tmp_path / "ds" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert load_records(str(tmp_path / "ds")) == ROWS
    with pytest.raises(ConfigError, match="choose one with `split:`"):
        load_records(str(tmp_path / "ds"), split="test")


def test_dataset_tokenizes_and_keeps_metadata(tmp_path, tok):
    src = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = PromptDataset.load(DataOptions(source=str(src)), tok)
    assert len(ds) == 3
    item = ds[1]
    assert item.text == "copy:47=" and tok.decode(item.prompt_ids) == "copy:47="
    assert item.metadata == {"answer": "47", "id": "b", "index": 1}
    with pytest.raises(ConfigError, match="row 0 has 5 prompt tokens > 4") as exc:
        PromptDataset(ROWS, tok, DataOptions(source="x", max_prompt_length=4))
    assert exc.value.path == "data.max_prompt_length"
    cut = PromptDataset(ROWS, tok, DataOptions(source="x", max_prompt_length=4, truncation="left"))
    assert tok.decode(cut[0].prompt_ids) == "123="
    with pytest.raises(ConfigError, match="no 'question' field"):
        PromptDataset(ROWS, tok, DataOptions(source="x", prompt_key="question"))


def test_chat_template_is_applied_when_the_tokenizer_has_one(tok):
    chat_tok = builtin_tokenizer()
    chat_tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    ds = PromptDataset(ROWS[:1], chat_tok, DataOptions(source="x"))
    assert ds[0].text == "<user>last:123=\n<assistant>"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ds = PromptDataset([{"prompt": messages}], chat_tok, DataOptions(source="x"))
    assert ds[0].text == "<system>be brief\n<user>hi\n<assistant>"
    plain = PromptDataset(ROWS[:1], chat_tok, DataOptions(source="x", chat_template="never"))
    assert plain[0].text == "last:123="
    with pytest.raises(ConfigError, match="need a tokenizer with a chat template"):
        PromptDataset([{"prompt": messages}], tok, DataOptions(source="x"))


def test_stream_is_seeded_epoch_aware_and_resumable(tok):
    ds = PromptDataset.load(DataOptions(source="task:last_digit", task_size=10), tok)
    a = PromptStream(ds, seed=5)
    seen = [it.metadata["index"] for _ in range(5) for it in a.next_batch(4)]  # 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # reshuffled per epoch
    b = PromptStream(ds, seed=5)
    b.next_batch(7)
    state = b.state_dict()
    c = PromptStream(ds, seed=0)
    c.load_state_dict(state)
    assert [it.metadata["index"] for it in c.next_batch(9)] == seen[7:16]


def test_collate_and_metadata_round_trip(tok):
    ds = PromptDataset(ROWS, tok, DataOptions(source="x"))
    batch = collate_prompts(ds.items, tok.pad_token_id)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    assert ids.shape == mask.shape == (3, max(len(i.prompt_ids) for i in ds.items))
    for row, item in zip(range(3), ds.items, strict=True):
        n = len(item.prompt_ids)
        assert ids[row, -n:].tolist() == item.prompt_ids  # left padding
        assert mask[row].tolist() == [0] * (ids.shape[1] - n) + [1] * n
        assert bool((ids[row, : ids.shape[1] - n] == tok.pad_token_id).all())
    assert decode_metadata(batch["metadata_json"]) == [i.metadata for i in ds.items]
    odd = [{"x": "é\u0000", "n": [1, 2]}, {}]
    assert decode_metadata(encode_metadata(odd)) == odd
    with pytest.raises(ValueError, match="row 0 is not UTF-8 JSON"):
        decode_metadata(torch.tensor([[123, 0]], dtype=torch.uint8))
    sft = collate_sft([{"prompt": "copy:47=", "response": "47"}], tok)
    assert sft["response_ids"][0].tolist() == tok("47", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id
    ]
    assert sft["response_mask"].tolist() == [[1, 1, 1]]


def test_prompt_source_for_the_runtime(tmp_path):
    from hybridflow.pipeline.sources.prompt_source import PromptSource

    fields = ("prompt_ids", "prompt_mask", "metadata_json", "sample_idx")
    opts = {"source": "task:last_digit", "task_size": 5, "tokenizer": "builtin"}
    src = PromptSource(fields, opts, seed=3)
    again = PromptSource(fields, opts, seed=3)
    b1 = src.batch(step=1, size=4)  # samples 4..7: crosses into the second epoch
    assert set(b1) == set(fields) and b1["prompt_ids"].shape[0] == 4
    assert all(torch.equal(b1[k], again.batch(1, 4)[k]) for k in fields)
    assert b1["sample_idx"].tolist() == [4, 5, 6, 7]
    rows = [m["index"] for m in decode_metadata(src.batch(0, 5)["metadata_json"])]
    assert sorted(rows) == list(range(5))  # one epoch visits every row once
    meta = decode_metadata(b1["metadata_json"])
    assert all(m["task"] == "last_digit" and "answer" in m for m in meta)
    assert not torch.equal(
        b1["prompt_ids"], PromptSource(fields, opts, seed=4).batch(1, 4)["prompt_ids"]
    )
    with pytest.raises(ConfigError, match=r"data\.fields\[0\]"):
        PromptSource(("rewards",), opts, seed=0)
    with pytest.raises(ConfigError, match=r"data\.options\.tokenizer"):
        PromptSource(fields, {"source": "task:copy"}, seed=0)
    with pytest.raises(ConfigError, match=r"data\.options\.sauce"):
        PromptSource(fields, {**opts, "sauce": 1}, seed=0)
