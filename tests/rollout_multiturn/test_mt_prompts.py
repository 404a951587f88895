"""Prompts that show the model its tools: the data option `tools` (data/prompts.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridflow.data.prompts import DataOptions, PromptDataset, make_item, tool_schemas
from hybridflow.errors import ConfigError
from hybridflow.stages.env.builtin.calculator import CalculatorEnv
from hybridflow.stages.env.observations import ObservationEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "env"))
from env_helpers import chatml_tokenizer

CALC = "hybridflow.stages.env.builtin.calculator:CalculatorEnv"
RECORDS = [
    {"prompt": "Ann has 7 apples. She buys 5 more. How many?", "answer": "12"},
    {"prompt": [{"role": "user", "content": "How many apples?"}], "answer": "3"},
]


class _Recording:
    """A tokenizer stand-in that records the keyword arguments of apply_chat_template."""

    chat_template = "x"
    calls: list[dict]

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, **kw):
        self.calls.append(kw)
        return messages[-1]["content"]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1] * len(text.split())}


def test_without_tools_the_template_is_called_as_before():
    tok = _Recording()
    PromptDataset(RECORDS, tok, DataOptions(source="x"))
    assert tok.calls == [{"tokenize": False, "add_generation_prompt": True}] * 2


def test_tools_name_an_environment_whose_schemas_the_prompt_shows():
    tok = chatml_tokenizer()
    opts = DataOptions(source="x", tools=[CALC], max_prompt_length=1024)
    item = PromptDataset(RECORDS, tok, opts)[0]
    schemas = CalculatorEnv().tools_schema()
    assert tool_schemas([CALC]) == schemas
    messages = [{"role": "user", "content": RECORDS[0]["prompt"]}]
    want = tok.apply_chat_template(
        messages, tools=schemas, tokenize=False, add_generation_prompt=True
    )
    assert item.text == want and '"name": "calc"' in item.text
    plain = make_item(0, RECORDS[0], tok, DataOptions(source="x"), True, "data")
    assert "calc" not in plain.text and item.prompt_ids != plain.prompt_ids
    # the prompt and the rollout's observations are templated with the same tools
    enc = ObservationEncoder(
        tok, tools=schemas, stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")]
    )
    assert enc.prompt_ids(messages) == item.prompt_ids


def test_a_tools_entry_that_names_no_schemas_is_a_config_error():
    with pytest.raises(ConfigError, match=r"data.tools\[0\]: .*package.module:attr"):
        DataOptions(source="x", tools=["calc"]).validate("data")
    with pytest.raises(ConfigError, match=r"data.tools\[0\]: .*is a function: name an environment"):
        tool_schemas(["hybridflow.stages.env.builtin.calculator:calc"], "data")
    with pytest.raises(ConfigError, match=r"data.tools: two tools share the name\(s\) \['calc'\]"):
        tool_schemas([CALC, CALC], "data")
    with pytest.raises(ConfigError, match=r"data.tools: .*tokenizer has none"):
        make_item(0, RECORDS[0], object(), DataOptions(source="x", tools=[CALC]), False, "data")
