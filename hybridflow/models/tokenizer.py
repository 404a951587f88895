"""The built-in tokenizer: a small BPE vocabulary trained in-process with `tokenizers`.

No pretrained tokenizer can be downloaded, so demos and tests use this one. It is trained
on a fixed corpus (the built-in tasks' prompts and answers plus a little English), so it
is identical in every process and on every machine: same corpus + same trainer settings
give the same merges (`tokenizers`' BPE trainer breaks ties deterministically).

Produces a `transformers.PreTrainedTokenizerFast` with:
  - special tokens `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3 (ids fixed by their order);
  - printable ASCII, tab and newline as the base alphabet; anything else is `<unk>`;
  - every digit its own token (so digit tasks are learnable token by token);
  - spaces kept as a `▁` marker (Metaspace), so `decode(encode(s)) == s` for ASCII text;
  - left padding (what batched generation needs);
  - no chat template (prompts of the built-in tasks are plain text).
"""

from __future__ import annotations

import functools
import string
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD, EOS, BOS, UNK = SPECIAL_TOKENS
DEFAULT_VOCAB_SIZE = 192

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from feedback "
    "trains a policy to maximise a reward. Answer the question. What is the answer? "
    "Explain it in simple terms. Yes or no. The result is correct."
)


def _corpus() -> list[str]:
    # Imported here, not at the top: the corpus is needed only when a tokenizer is trained.
    from hybridflow.data.tasks import TASKS

    lines = [_ENGLISH] * 8
    for task in TASKS.values():
        for rec in task.prompts(200, seed=0):
            # Prompt and answer as separate lines: no merge may span the boundary, so
            # the answer's tokens are the same whether or not it follows its prompt.
            lines += [rec["prompt"], rec["answer"]]
    return lines


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    alphabet = [*sorted(set(string.printable) - set(" \r\x0b\x0c")), "▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def builtin_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """A fresh `PreTrainedTokenizerFast` wrapping the built-in BPE (cached training)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 100:
        raise ValueError(f"builtin tokenizer vocab_size must be >= 104, got {vocab_size}")
    tok = Tokenizer.from_str(_trained_json(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )
