"""Time and kernel count of the native sampler (stages/rollout/native/sampling/sampler.py) against
the former one, kept below as `former_sample_baseline`.

    python bench/sampler.py                          # B=256, V=151,936, cuda if present
    python bench/sampler.py --device cpu --repeats 3
    python bench/sampler.py --graph                  # CUDA: also time CUDA-graph replays
    python bench/sampler.py --compile                # also torch.compile(sample), fused

Logits [B, V] float32 (randn * 3), per-row uniforms from `row_uniform`. Two batches:
  plain     truncate=False, every row at temperature 1 (an RL rollout's setting)
  truncate  truncate=True, temperature 0.7, top_p 0.95 on every row, top_k 50 on half
Per variant (former / new; on plain also new_logcumsumexp, a candidate kept here, see
its docstring): ms per call (median of --repeats after --warmup calls, with
torch.cuda.synchronize around each on CUDA), and ops per call from torch.profiler: on
CUDA the number of kernel launches (memsets and copies included), on CPU the number of
aten ops called from Python (top level) and in all, and on both the number of those
top-level ops that touch [B, V] elements (the passes over the vocabulary). `agree`: the
fraction of rows where new and former draw the same token, and for each the fraction
where it draws the token of the former sampler run in float64 and its largest log-prob
error against float64 on those rows. Printed as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def _load_sampler() -> Any:
    """sampler.py by path: it needs torch alone, and importing it through the package
    would pull in the transport's pyzmq and msgspec (absent on the GPU host)."""
    path = Path(__file__).parents[1] / "hybridflow/stages/rollout/native/sampling/sampler.py"
    spec = importlib.util.spec_from_file_location("native_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_sampler = _load_sampler()
row_uniform, sample, split_seed = _sampler.row_uniform, _sampler.sample, _sampler.split_seed
Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def former_logp(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    truncate: bool,
) -> torch.Tensor:
    """The former sampler's distribution (sampler.py at 393e197): [B, V] log-probs.
    tests/rollout_native/test_native_sampler_passes.py uses it as the reference too."""
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if truncate:
        vocab = logits.shape[-1]
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = ordered.gather(-1, (k - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        p = torch.where(top_p < 1, top_p, torch.full_like(top_p, 2.0))
        drop = (probs.cumsum(-1) - probs) >= p[:, None]
        kept = torch.log_softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
        kept = torch.full_like(kept, float("-inf")).scatter(-1, order, kept)
        truncating = ((top_k > 0) | (top_p < 1)) & ~greedy
        logp = torch.where(truncating[:, None], kept, logp)
    return logp


def former_sample_baseline(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler before the few-pass rework (sampler.py at 393e197), the baseline."""
    logp = former_logp(logits, temperature, top_k, top_p, truncate)
    probs = logp.exp()
    cdf = probs.cumsum(-1)
    x = u * cdf[:, -1]
    idx = (cdf <= x[:, None]).sum(-1)
    cols = torch.arange(logp.shape[-1], device=logp.device)
    last = torch.where(probs > 0, cols, -1).amax(-1)
    tok = torch.where(temperature <= 0, logits.argmax(-1), torch.minimum(idx, last))
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def logcumsumexp_candidate(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A candidate for untruncated batches, measured, not shipped: the CDF in log space
    by one logcumsumexp (scale, logcumsumexp, argmax: three passes, but a log-add-exp per
    element; on CPU it is compute-bound, ~6x a cumsum). Its last entry is the row's
    log-normaliser, so log p(tok) = logits[tok] / T - lcse[-1]."""
    assert not truncate, "untruncated batches only"
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    lcse = torch.logcumsumexp(scaled, -1)  # [B, V]
    lse = lcse[:, -1]
    x = torch.minimum(u.log() + lse, torch.nextafter(lse, torch.full_like(lse, -math.inf)))
    idx = torch.searchsorted(lcse, x[:, None], right=True).squeeze(-1).clamp(max=lcse.shape[-1] - 1)
    argmax = logits.argmax(-1)
    picked = scaled.gather(-1, idx[:, None]).squeeze(-1)
    tok = torch.where(greedy | (picked == -math.inf), argmax, idx)
    return tok, scaled.gather(-1, tok[:, None]).squeeze(-1) - lse


def inputs(b: int, v: int, truncate: bool, device: torch.device) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(b, v, generator=gen) * 3).to(device)
    lo, hi = split_seed(1234)
    rows = torch.arange(b)
    u = row_uniform(torch.full((b,), lo), torch.full((b,), hi), rows, torch.zeros_like(rows))
    temp = torch.full((b,), 0.7 if truncate else 1.0)
    top_k = torch.where(rows % 2 == 0, 50, 0) if truncate else torch.zeros(b, dtype=torch.int64)
    top_p = torch.full((b,), 0.95 if truncate else 1.0)
    return (logits, *(x.to(device) for x in (temp, top_k, top_p, u)), truncate)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def count_ops(fn: Callable[[], object], device: torch.device, full: int) -> dict[str, int]:
    """CUDA: kernel launches (and memsets/copies) of one call; CPU: aten ops. Both: the
    top-level aten ops that touch [B, V] (`full`) elements, the passes over the vocabulary
    (a composite op such as log_softmax counts once though it makes several)."""
    fn()  # lazy initialisation outside the profile
    _sync(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
        _sync(device)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None]
    counts = {"full_vocab_ops": sum(_work(e.name, e.input_shapes) >= full for e in top)}
    if device.type == "cuda":
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"cuda_kernels": len(gpu), **counts}
    return {"aten_ops_top_level": len(top), "aten_ops_all": len(aten), **counts}


_VIEWS = {"aten::select", "aten::slice", "aten::squeeze", "aten::unsqueeze", "aten::view"}
_BY_SECOND = {"aten::gather", "aten::searchsorted"}  # work scales with the index/values


def _work(name: str, shapes: Any) -> int:
    """Elements an op reads or writes at most, from its recorded input shapes: the
    largest input or broadcast result; gather/searchsorted by their second tensor."""
    tensors = [tuple(s) for s in shapes or [] if isinstance(s, list) and s]
    if name in _VIEWS or not tensors:
        return 0
    if name in _BY_SECOND and len(tensors) > 1:
        return math.prod(tensors[1])
    sizes = [math.prod(s) for s in tensors]
    with contextlib.suppress(RuntimeError):  # inputs that do not broadcast (cat, ...)
        sizes.append(math.prod(torch.broadcast_shapes(*tensors)))
    return int(max(sizes))


def graph_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Replay time of `fn` captured in a CUDA graph (the engine's decode path)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, torch.device("cuda"), warmup, repeats)


def agreement(args: tuple[Any, ...]) -> dict[str, float]:
    """Same-token fractions and max log-prob errors against the former sampler in
    float64 (the exact distribution, up to u's own 2^-23 resolution)."""
    exact_tok, exact_lp = former_sample_baseline(args[0].double(), *args[1:])
    out: dict[str, float] = {}
    tok, lp = sample(*args)
    ref_tok, ref_lp = former_sample_baseline(*args)
    out["same_token_as_former"] = float((tok == ref_tok).float().mean())
    runs = {"new": (tok, lp), "former": (ref_tok, ref_lp)}
    if not args[-1]:
        runs["new_logcumsumexp"] = logcumsumexp_candidate(*args)
    for name, (t, lps) in runs.items():
        same = t == exact_tok
        out[f"{name}_same_token_as_float64"] = float(same.float().mean())
        out[f"{name}_max_logprob_err"] = float((lps.double() - exact_lp)[same].abs().max())
    return out


def run(opts: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out: dict[str, Any] = {"device": str(device), "batch": opts.batch, "vocab": opts.vocab}
    out["torch"] = torch.__version__
    variants: dict[str, Sampler] = {"former": former_sample_baseline, "new": sample}
    if opts.compile:  # a measurement only: the package ships the eager sampler
        variants["new_compiled"] = torch.compile(sample, dynamic=False)
    for case, truncate in (("plain", False), ("truncate", True)):
        args = inputs(opts.batch, opts.vocab, truncate, device)
        res: dict[str, Any] = {}
        extra = {"new_logcumsumexp": logcumsumexp_candidate} if not truncate else {}
        for name, fn in {**variants, **extra}.items():
            call = lambda fn=fn, args=args: fn(*args)  # noqa: E731
            row: dict[str, Any] = {"ms": time_ms(call, device, opts.warmup, opts.repeats)}
            row.update(count_ops(call, device, opts.batch * opts.vocab))
            if opts.graph and device.type == "cuda":
                row["graph_ms"] = graph_ms(call, opts.warmup, opts.repeats)
            res[name] = row
        res["speedup"] = round(res["former"]["ms"] / res["new"]["ms"], 2)
        res["agree"] = agreement(args)
        out[case] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--graph", action="store_true", help="CUDA: also time graph replays")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(sample)")
    opts = ap.parse_args()
    with torch.no_grad():
        print(json.dumps(run(opts), indent=2))


if __name__ == "__main__":
    main()
