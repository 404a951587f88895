"""Peak memory and time of token log-probs + entropy through the output head: the full
[N, V] logits against chunks of tokens (models/head_logprobs.py).

    python bench/logprob_memory.py                        # N=2048, Qwen2-0.5B's head
    python bench/logprob_memory.py --tokens 4096 --chunks 256 1024 --repeats 2
    python bench/logprob_memory.py --device cuda:0 --dtype bfloat16   # GPU (not run yet)

The work is one training forward and backward of what the actor computes for its loss:
hidden [N, H] (requires grad) through the head W [V, H] (requires grad) at temperature
0.8, log p(target) and entropy both with grad (entropy_coef > 0, the costliest case),
loss = sum(a * logp + b * H) with fixed random a, b. `no_grad` variants are the
reference's / old log-probs' forward alone.

  full      the former path: logits = head(h) [N, V], logprobs_from_logits and
            entropy_from_logits over them (algos/losses.py)
  chunk_C   head_logprobs(..., chunk_tokens=C)

Each variant runs in its own subprocess (peak memory is per process). On CPU the peak is
the process's peak RSS (VmHWM, reset through /proc/self/clear_refs once the inputs are
built) minus its RSS then: it counts every temporary of the step, and the head's weight
gradient (V x H, 545 MB at fp32), which every variant allocates. On CUDA it is
torch.cuda.max_memory_allocated minus the allocated bytes before the step. Printed
(JSON): per variant peak_mb, wall_s (the fastest of --repeats), and the max abs
difference of logp / entropy / grad_hidden / grad_weight against the full variant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from hybridflow.algos.losses import entropy_from_logits, logprobs_from_logits
from hybridflow.models.head_logprobs import head_logprobs

TEMPERATURE = 0.8


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    n, h, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(n, h, generator=g).to(dev, dtype).requires_grad_(True)
    weight = torch.randn(v, h, generator=g).mul_(h**-0.5).to(dev, dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g).to(dev)
    up = torch.randn(2, n, generator=g).to(dev)
    return hidden, weight, targets, up


def _step(variant: str, grad: bool, hidden, weight, targets, up) -> tuple[torch.Tensor, ...]:
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = torch.nn.Parameter(weight, requires_grad=grad)  # the same storage
    with torch.set_grad_enabled(grad):
        if variant == "full":
            logits = head(hidden) / TEMPERATURE
            lp = logprobs_from_logits(logits[None], targets[None])[0]
            ent = (
                entropy_from_logits(logits)
                if grad
                else entropy_from_logits(logits, chunk_size=1024)
            )
        else:
            chunk = int(variant.removeprefix("chunk_"))
            lp, ent = head_logprobs(
                hidden,
                targets,
                head,
                temperature=TEMPERATURE,
                chunk_tokens=chunk,
                with_entropy=True,
            )
            assert ent is not None
        if not grad:
            return lp.detach(), ent.detach()
        gh, gw = torch.autograd.grad((up[0] * lp + up[1] * ent).sum(), [hidden, head.weight])
    return lp.detach(), ent.detach(), gh, gw


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(key + ":"))
    return int(line.split()[1]) / 1024  # kB


def _reset_peak_rss() -> float:
    """Reset the process's peak RSS (VmHWM) to its current RSS; -> that RSS in MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def _child(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    cuda = args.device.startswith("cuda")
    inputs = _inputs(args)
    grad = args.mode == "train"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_peak_rss()
    times, out = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = _step(args.variant, grad, *inputs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (
        (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else _status_mb("VmHWM") - base
    )
    assert out is not None
    torch.save([t.cpu() for t in out], args.save)
    return {"peak_mb": round(peak, 1), "wall_s": round(min(times), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=896)  # Qwen2-0.5B
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--modes", nargs="+", default=["train", "no_grad"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variant:
        print(json.dumps(_child(args)))
        return
    shape = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab}
    report: dict[str, Any] = {**shape, "device": args.device, "dtype": args.dtype}
    report["full_logits_fp32_mb"] = round(args.tokens * args.vocab * 4 / 2**20, 1)
    tmp = f"/tmp/logprob_memory_{os.getpid()}"
    for mode in args.modes:
        rows: dict[str, Any] = {}
        ref = None
        for variant in ["full", *(f"chunk_{c}" for c in args.chunks)]:
            save = f"{tmp}_{mode}_{variant}.pt"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
            cmd += ["--mode", mode, "--save", save]
            got = subprocess.run(cmd, check=True, capture_output=True, text=True)
            row = json.loads(got.stdout.strip().splitlines()[-1])
            tensors = torch.load(save)
            os.unlink(save)
            if ref is None:
                ref = tensors
            else:
                names = ("logp", "entropy", "grad_hidden", "grad_weight")
                row["max_abs_diff"] = {
                    n: float((a.float() - b.float()).abs().max())
                    for n, a, b in zip(names, tensors, ref, strict=False)
                }
            rows[variant] = row
        report[mode] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
