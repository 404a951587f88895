"""Tokenizers with chat templates for the environment tests (built in-process: no
download). CHATML is a hand-written ChatML template in the Qwen2.5 style: tools in a
system block, consecutive `tool` messages grouped in one `user` turn as
<tool_response> blocks, `<|im_end|>` ending every turn."""

from __future__ import annotations

import functools
from typing import Any

from hybridflow.models.tokenizer import builtin_tokenizer, train_tokenizer

CHATML = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nYou may call these tools:' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    '{{- \'\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# role line, content, <eos>, newline: the built-in tokenizer's <eos> is its one special
# separator, and no corpus line holds a newline, so no merge spans one.
SIMPLE = (
    "{%- for m in messages -%}{{- m.role + ':\\n' + m.content + eos_token + '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:\\n' -}}{%- endif -%}"
)

_CORPUS = [
    "Ann has 7 apples. She buys 5 more. How many apples does Ann have now?",
    "Ann has 7+5=12 apples. The answer is 12.",
    '<tool_call>{"name": "calc", "arguments": {"expression": "7 + 5"}}</tool_call>',
    "tool_response user assistant system You may call these tools",
]


@functools.lru_cache(maxsize=1)
def _chatml() -> Any:
    return train_tokenizer(_CORPUS * 20, 200, CHATML)


def chatml_tokenizer() -> Any:
    return _chatml()


def simple_tokenizer() -> Any:
    tok = builtin_tokenizer()
    tok.chat_template = SIMPLE
    return tok


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))
