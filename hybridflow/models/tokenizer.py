"""Tokenizers trained in-process with `tokenizers`: the built-in one, and `train_tokenizer`.

No pretrained tokenizer can be downloaded, so demos and tests use the built-in one. It is
trained on a fixed corpus (the built-in tasks' prompts and answers plus a little English),
so it is identical in every process and on every machine: same corpus + same trainer
settings give the same merges (`tokenizers`' BPE trainer breaks ties deterministically).
`train_tokenizer(corpus, vocab_size, chat_template)` runs the same trainer on a user's
corpus (e.g. a dataset's questions and solutions: examples/math_rl.py) and can carry a
chat template (CHAT_TEMPLATE: `<|user|>` / `<|assistant|>` markers; TOOL_CHAT_TEMPLATE adds
the `<|tool|>` role of multi-turn rollouts).

Both produce a `transformers.PreTrainedTokenizerFast` with:
  - special tokens `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3 (ids fixed by their order),
    then the chat template's `<|name|>` markers (train_tokenizer only);
  - printable ASCII, tab and newline as the base alphabet; anything else is `<unk>`;
  - every digit its own token (so digit tasks are learnable token by token);
  - spaces kept as a `▁` marker (Metaspace), so `decode(encode(s)) == s` for ASCII text;
  - left padding (what batched generation needs);
  - the built-in one has no chat template (prompts of the built-in tasks are plain text),
    and its vocabulary never changes: demos and tests depend on it id for id.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD, EOS, BOS, UNK = SPECIAL_TOKENS
DEFAULT_VOCAB_SIZE = 192

# A minimal chat template for tokenizers trained with `train_tokenizer`:
#   <bos><|user|>\n{content}\n<|assistant|>\n{content}<eos>\n ...
# and, with add_generation_prompt, a trailing "<|assistant|>\n": the prompt ends on a
# newline token, so the response starts a fresh pre-token (its tokens are the same
# whether it is tokenized alone, as SFT does, or sampled after the prompt).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>"
    "{%- elif message['role'] == 'user' -%}<|user|>"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>"
    "{%- else -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{- '\\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{{- '\\n' -}}{%- endif -%}"
)
# CHAT_TEMPLATE plus the `tool` role of multi-turn rollouts (stages/env: a ToolEnv's
# observation is one {"role": "tool", ...} message per call), as <|tool|>\n{content}\n.
# Tool schemas (`tools=`) are not rendered: a model trained from scratch learns its tools
# from demonstrations (examples/agent_math.py), and every prompt stays as short as
# without them. Prefix-stable, as the trajectory loop's ObservationEncoder requires.
TOOL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>",
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>"
    "{%- elif message['role'] == 'tool' -%}<|tool|>",
)
_MARKER = re.compile(r"<\|[A-Za-z0-9_]+\|>")

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from feedback "
    "trains a policy to maximise a reward. Answer the question. What is the answer? "
    "Explain it in simple terms. Yes or no. The result is correct."
)


CORPUS_TASKS = ("last_digit", "copy", "parity")


def _corpus() -> list[str]:
    # Imported here, not at the top: the corpus is needed only when a tokenizer is trained.
    from hybridflow.data.tasks import TASKS

    lines = [_ENGLISH] * 8
    # The tasks the builtin tokenizer was trained on; a task added later stays out, so the
    # builtin vocabulary (and every run and test on it) never changes under a new task.
    for name in CORPUS_TASKS:
        for rec in TASKS[name].prompts(200, seed=0):
            # Prompt and answer as separate lines: no merge may span the boundary, so
            # the answer's tokens are the same whether or not it follows its prompt.
            lines += [rec["prompt"], rec["answer"]]
    return lines


def _alphabet() -> list[str]:
    return [*sorted(set(string.printable) - set(" \r\x0b\x0c")), "▁"]


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    return _train_json(_corpus(), vocab_size, SPECIAL_TOKENS)


def _train_json(corpus: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> str:
    """The one BPE trainer (built-in and user tokenizers): Metaspace, single digits,
    printable ASCII alphabet; `special_tokens` take ids 0.. in their order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=_alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok.to_str()


def builtin_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """A fresh `PreTrainedTokenizerFast` wrapping the built-in BPE (cached training)."""
    if vocab_size < len(SPECIAL_TOKENS) + 100:
        raise ValueError(f"builtin tokenizer vocab_size must be >= 104, got {vocab_size}")
    return _wrap(_trained_json(vocab_size), None)


def train_tokenizer(
    corpus: Iterable[str], vocab_size: int, chat_template: str | None = None
) -> Any:
    """A `PreTrainedTokenizerFast` trained on `corpus` with the built-in one's trainer:
    the same special tokens and ids, digits split, Metaspace, left padding.

    `chat_template` (Jinja, e.g. CHAT_TEMPLATE) becomes the tokenizer's chat template;
    every `<|name|>` marker it writes is added as a special token (ids 4.. in order of
    appearance, inside `vocab_size`), so a marker is always one token and no merge spans
    it. Deterministic in (corpus, vocab_size, chat_template). `save_pretrained(dir)`
    writes a directory that `tokenizer: <dir>` options load back (models/loader.py).
    """
    markers = tuple(dict.fromkeys(_MARKER.findall(chat_template or "")))
    special = (*SPECIAL_TOKENS, *markers)
    if vocab_size < len(special) + len(_alphabet()):
        raise ValueError(
            f"vocab_size must be >= {len(special) + len(_alphabet())} (special tokens and "
            f"the base alphabet), got {vocab_size}"
        )
    lines = [line for line in corpus if line]
    if not lines:
        raise ValueError("train_tokenizer: the corpus is empty")
    return _wrap(_train_json(lines, vocab_size, special), chat_template)


def _wrap(tokenizer_json: str, chat_template: str | None) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    kwargs = {} if chat_template is None else {"chat_template": chat_template}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
        **kwargs,
    )
