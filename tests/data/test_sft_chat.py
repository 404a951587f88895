"""A trained tokenizer with a chat template, and SFT on chat prompts: the sft source
gives a verl record exactly the prompt tokens the RL prompt source gives it."""

from __future__ import annotations

import hashlib

import pytest

from hybridflow.data import word_problems as wp
from hybridflow.data.batching import collate_sft
from hybridflow.errors import ConfigError
from hybridflow.models.loader import load_tokenizer
from hybridflow.models.tokenizer import CHAT_TEMPLATE, builtin_tokenizer, train_tokenizer
from hybridflow.pipeline.sources.prompt_source import PromptSource
from hybridflow.pipeline.sources.sft import SFTExamples, field_at

SFT_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
MESSAGES = [{"role": "user", "content": "Ann has 7 apples. How many?"}]


def _corpus(records):
    for r in records:
        yield r["prompt"][0]["content"]
        yield r["extra_info"]["answer"]


@pytest.fixture(scope="module")
def records():
    return wp.generate(64, seed=0)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, records):
    tok = train_tokenizer(_corpus(records), 200, chat_template=CHAT_TEMPLATE)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(out))
    return out


def test_builtin_tokenizer_is_unchanged_byte_for_byte():
    tok = builtin_tokenizer()
    # The serialized BPE of the built-in tokenizer before train_tokenizer shared its
    # trainer: demos and tests depend on it id for id.
    digest = hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
    assert digest == "e3b9df7d59f4d3481a52b9ac7d67271de8b184f4643a1dc18b497e42bf758a5e"
    assert tok.chat_template is None and len(tok) == 192


def test_train_tokenizer_special_tokens_digits_and_markers(records):
    tok = train_tokenizer(_corpus(records), 200, chat_template=CHAT_TEMPLATE)
    assert len(tok) == 200
    assert [tok.convert_ids_to_tokens(i) for i in range(7)] == [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
    ]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    ids = tok("12+345=357", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:2] == ["1", "2"]  # digits stay single
    text = records[0]["extra_info"]["answer"]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # No chat template: no markers, the vocabulary is all BPE.
    plain = train_tokenizer(_corpus(records), 200)
    assert plain.chat_template is None and plain.convert_ids_to_tokens(4) != "<|system|>"
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], 50)


def test_chat_template_and_generation_prompt(chat_dir):
    tok = load_tokenizer(str(chat_dir))
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|user|>\nAnn has 7 apples. How many?\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [2, 5] and tok.convert_ids_to_tokens(ids[-2:]) == ["<|assistant|>", "\n"]
    full = tok.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": "#### 7"}], tokenize=False
    )
    assert full == text + "#### 7<eos>\n"
    assert tok.decode(ids, skip_special_tokens=True) == "\nAnn has 7 apples. How many?\n\n"


def test_saved_tokenizer_round_trips_through_load_tokenizer(chat_dir, records):
    tok = load_tokenizer(str(chat_dir))
    fresh = train_tokenizer(_corpus(records), 200, chat_template=CHAT_TEMPLATE)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.get_vocab() == fresh.get_vocab() and len(tok) == len(fresh)
    text = fresh.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok(text)["input_ids"] == fresh(text)["input_ids"]


def test_sft_prompt_ids_equal_the_rl_prompt_ids(chat_dir, tmp_path):
    train, _ = wp.write_dataset(tmp_path, 16, 2, seed=1)
    common = {"source": str(train), "tokenizer": str(chat_dir), "shuffle": False}
    sft = SFTExamples(SFT_FIELDS, {**common, "response_key": "extra_info.answer"}, seed=0)
    rl = PromptSource(("prompt_ids", "prompt_mask"), common, seed=0)
    a, b = sft.batch(0, 16), rl.batch(0, 16)
    assert a["prompt_ids"].tolist() == b["prompt_ids"].tolist()
    assert a["prompt_mask"].tolist() == b["prompt_mask"].tolist()
    tok = load_tokenizer(str(chat_dir))
    first = wp.generate(16, seed=1)[0]
    row = a["response_ids"][0][a["response_mask"][0].bool()].tolist()
    assert row == tok(first["extra_info"]["answer"], add_special_tokens=False)["input_ids"] + [1]
    prompt = tok.decode(a["prompt_ids"][0][a["prompt_mask"][0].bool()])
    assert prompt.startswith("<bos><|user|>\n") and prompt.endswith("<|assistant|>\n")
    # chat_template: never -> chat messages cannot be tokenized (as in the RL source)
    with pytest.raises(ConfigError, match="chat template"):
        SFTExamples(
            SFT_FIELDS,
            {**common, "response_key": "extra_info.answer", "chat_template": "never"},
            seed=0,
        )


def test_string_prompts_keep_the_old_tokenization(tmp_path):
    from hybridflow.data.tasks import TASKS

    tok = builtin_tokenizer()
    opts = {"source": "task:copy", "tokenizer": "builtin", "task_size": 32, "shuffle": False}
    src = SFTExamples((*SFT_FIELDS, "sample_idx"), opts, seed=0)
    # The string path of collate_sft (tokenized there, special tokens added) is unchanged,
    # and the source's ids (through make_item) are the same.
    old = collate_sft(TASKS["copy"].sft_examples(32, seed=0)[:8], tok)
    new = src.batch(0, 8)
    assert new.pop("sample_idx").tolist() == list(range(8))
    assert {k: v.tolist() for k, v in new.items()} == {k: v.tolist() for k, v in old.items()}
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "copy:47=", "response": "47"}\n')
    batch = SFTExamples(SFT_FIELDS, {"source": str(path), "tokenizer": "builtin"}, 0).batch(0, 1)
    assert batch["prompt_ids"].tolist() == [tok("copy:47=")["input_ids"]]


def test_response_key_errors_and_dotted_paths(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "copy:4=", "out": {"text": 4}}\n')
    with pytest.raises(ConfigError, match=r"no string at 'out\.text'") as exc:
        SFTExamples(
            SFT_FIELDS, {"source": str(path), "tokenizer": "builtin", "response_key": "out.text"}, 0
        )
    assert exc.value.path == "data.options.response_key"
    assert field_at({"a": {"b": "x"}}, "a.b") == "x"
    assert field_at({"a.b": "y", "a": {"b": "x"}}, "a.b") == "y"
    assert field_at({"a": "x"}, "a.b") is None


def test_token_id_responses_keep_their_ids_and_mask(tmp_path, records, chat_dir):
    """A multi-turn demonstration given as ids: taken as is (no EOS added), its mask 0
    on the observation span; a bad mask or id list is named by its option key."""
    import json

    tok = load_tokenizer(str(chat_dir))
    turn = [*tok.encode("7+5", add_special_tokens=False), tok.eos_token_id]
    ids, mask = [*turn, 9, 10, *turn], [1] * len(turn) + [0, 0] + [1] * len(turn)
    rows = [{"prompt": MESSAGES, "response": ids, "response_mask": mask}]
    rows.append({"prompt": MESSAGES, "response": "12"})  # text beside ids in one batch
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = SFTExamples(SFT_FIELDS, {"source": str(path), "tokenizer": str(chat_dir)}, 0)
    by_len = sorted(src.pairs, key=lambda p: -len(p.get("response_ids", [])))
    batch = collate_sft(by_len, tok)
    assert batch["response_ids"][0].tolist() == ids
    assert batch["response_mask"][0].tolist() == mask
    text = [*tok.encode("12", add_special_tokens=False), tok.eos_token_id]
    assert batch["response_mask"][1].tolist() == [1] * len(text) + [0] * (len(ids) - len(text))
    for bad, key in (([*mask[:-1], 0], "response_mask_key"), ([1, 2], "response_mask_key")):
        path.write_text(json.dumps({"prompt": MESSAGES, "response": ids, "response_mask": bad}))
        with pytest.raises(ConfigError, match=rf"data\.options\.{key}: row 0"):
            SFTExamples(SFT_FIELDS, {"source": str(path), "tokenizer": str(chat_dir)}, 0)
    path.write_text(json.dumps({"prompt": MESSAGES, "response": [len(tok)]}))
    with pytest.raises(
        ConfigError, match=r"data\.options\.response_key: row 0 has no string at .* nor a list"
    ):
        SFTExamples(SFT_FIELDS, {"source": str(path), "tokenizer": str(chat_dir)}, 0)
