"""`python -m hybridflow.bench.logprob_gap --json`: the rollout/training log-prob mismatch.

One model (--model preset, --vocab-size override, builtin tokenizer, seed 0) is built once
in float32; the other precisions are cast copies of the same weights. The native engine
samples --max-new-tokens tokens (temperature 1, stop on EOS) for --seqs random prompts and
reports each token's log-prob; the actor's `response_logprobs` then recomputes them on the
same tokens (the [prompt | response] batch layout of stages/common.py). Settings:

  fp32                      float32 engine vs float32 actor
  bf16_engine_autocast_actor  bfloat16 engine vs float32 actor under bf16 autocast (the
                            grpo-gpu preset: rollout dtype bfloat16, actor autocast_bf16)
  bf16_engine_bf16_actor    bfloat16 engine vs bfloat16 actor weights
  ..._fp32_head             the two bf16 settings again with `fp32_lm_head` in engine and
                            actor (models/heads.py: the output head computed in float32)

A random-init model's logits are small (std ~0.6 for qwen2-0.5b), so rounding them to
bf16 costs little, unlike a trained model's (std of several units, peaks of 20-30), where
the output head's rounding becomes a visible part of the gap. --logit-scale S multiplies
the final norm's weight by S (it feeds only the head), giving logits S times the spread;
`logit_std` reports the spread over the prompts' positions (fp32 model).

JSON: {"bench": "logprob_gap", "logit_scale", "logit_std", "model", "device", "vocab_size", "tokens" (real response
tokens of the fp32 setting), "settings": {name: {"max_abs", "mean_abs", "tokens"} or
{"skipped": why}}}; max_abs / mean_abs are |rollout - actor| over response_mask = 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from typing import Any

import torch

from hybridflow.bench import with_options
from hybridflow.models.heads import use_fp32_head
from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer
from hybridflow.stages.common import chunked_no_grad, response_logprobs
from hybridflow.stages.rollout.native.engine import EngineConfig, NativeEngine
from hybridflow.stages.rollout.native.request import Request, SamplingParams

DEFAULTS = {"model": "tiny", "vocab_size": 0, "device": "", "seqs": 64, "max_new_tokens": 128}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridflow.bench.logprob_gap", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    p.add_argument(
        "--quick", action="store_true", help="tiny preset, 4 seqs, 8 tokens (same device)"
    )
    p.add_argument("--model", default=DEFAULTS["model"])
    p.add_argument("--vocab-size", type=int, default=0, help="override the preset's vocab")
    p.add_argument("--device", default="", help="default: cuda if available, else cpu")
    p.add_argument("--seqs", type=int, default=DEFAULTS["seqs"])
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"])
    p.add_argument(
        "--logit-scale",
        type=float,
        default=1.0,
        help="multiply the final norm's weight: a trained model's logit spread (see doc)",
    )
    return p.parse_args(argv)


def _bf16_ok(device: torch.device) -> str | None:
    """None if bfloat16 matmuls run on `device`, else why not."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU does not support bfloat16"
    try:
        x = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
        (x @ x).sum().item()
    except Exception as e:  # any failure means "unsupported here"
        return f"bfloat16 unsupported on {device.type}: {e}"
    return None


def _generate(model: Any, prompts: list[torch.Tensor], max_new: int, eos: int) -> Any:
    config = EngineConfig(
        max_model_len=max(p.numel() for p in prompts) + max_new,
        kv_cache_gb=4.0 if model.device.type == "cuda" else 0.5,
        max_num_seqs=len(prompts),
    )
    engine = NativeEngine(model, config)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=(eos,))
    rid = engine.add_request(Request(prompts, params, seed=0))
    outs = {}
    while engine.has_work():
        outs.update({o.request_id: o for o in engine.step()})
    engine.release()
    return outs[rid]


def _batch(prompts: list[torch.Tensor], out: Any, pad: int) -> dict[str, torch.Tensor]:
    """The rollout's layout: prompts left-padded, responses right-padded."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    pmask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel() :], pmask[i, width - p.numel() :] = p, 1
    rmask = (torch.arange(out.tokens.shape[1])[None, :] < out.lengths[:, None]).to(torch.int64)
    return {
        "prompt_ids": ids,
        "prompt_mask": pmask,
        "response_ids": torch.where(rmask.bool(), out.tokens, pad),
        "response_mask": rmask,
    }


def _gap(batch: dict[str, torch.Tensor], rollout: torch.Tensor, actor: Any, ac: bool) -> dict:
    device = next(actor.parameters()).device

    def fn(sub: dict[str, torch.Tensor]) -> torch.Tensor:
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if ac else contextlib.nullcontext()
        with ctx:
            return response_logprobs(actor, sub, device, 1.0)[0]

    recomputed = chunked_no_grad(fn, batch, 16)
    mask = batch["response_mask"].bool()
    diff = (rollout.float() - recomputed)[mask].abs()
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "tokens": diff.numel()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark; `args` may lack options (their defaults apply; from `hybridflow
    bench`, options come as --set KEY=VALUE); --quick shrinks it."""
    args = with_options(args, vars(parse([])), "logprob_gap")
    model_name = args.model or DEFAULTS["model"]
    vocab = args.vocab_size or 0
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    seqs = args.seqs or DEFAULTS["seqs"]
    max_new = args.max_new_tokens or DEFAULTS["max_new_tokens"]
    if getattr(args, "quick", False):  # sizes only: the device and settings stay the full run's
        model_name, seqs, max_new = "tiny", 4, 8
    device = torch.device(dev)
    tokenizer = load_tokenizer("builtin")
    overrides = {"vocab_size": vocab} if vocab else {}
    opts = ModelOptions(model=model_name, tokenizer="builtin", model_overrides=overrides)
    fp32 = load_model(opts, tokenizer, device=device, seed=0).requires_grad_(False)
    scale = float(args.logit_scale or 1.0)
    fp32.model.norm.weight.mul_(scale)
    v = fp32.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 17, (seqs,), generator=gen)
    prompts = [torch.randint(2, v, (int(n),), generator=gen) for n in lengths]
    with torch.no_grad():
        logit_std = float(fp32(input_ids=prompts[0][None].to(device)).logits.float().std())
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def rollout(engine_model: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out = _generate(engine_model, prompts, max_new, eos)
        batch = _batch(prompts, out, pad)
        return batch, out.logprobs * batch["response_mask"]

    settings: dict[str, Any] = {"fp32": _gap(*rollout(fp32), fp32, False)}
    why = _bf16_ok(device)
    names = ("bf16_engine_autocast_actor", "bf16_engine_bf16_actor")
    names += tuple(f"{n}_fp32_head" for n in names)
    if why is None:
        for head in ("", "_fp32_head"):
            actor = copy.deepcopy(fp32)
            bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
            if head:
                use_fp32_head(actor, "causal_lm")
                use_fp32_head(bf16, "causal_lm")
            batch, logprobs = rollout(bf16)  # one bf16 rollout, scored by both actors
            settings[f"{names[0]}{head}"] = _gap(batch, logprobs, actor, True)
            settings[f"{names[1]}{head}"] = _gap(batch, logprobs, bf16, False)
    else:
        settings.update({n: {"skipped": why} for n in names})
    return {
        "bench": "logprob_gap",
        "model": model_name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "vocab_size": v,
        "logit_scale": scale,
        "logit_std": round(logit_std, 3),
        "tokens": settings["fp32"]["tokens"],
        "settings": settings,
    }


if __name__ == "__main__":
    print(json.dumps(run(parse())))
