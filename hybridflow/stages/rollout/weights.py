"""How every rollout backend takes a weight update: one protocol (`WeightSink`), and the
in-place writer the hf and native engines share (`InPlaceWeights`; vllm.py adapts vLLM's
own loader to the same protocol).

An update arrives one of two ways, both through `WeightSink`:
  - `update(pairs)`: the in-process hand-off of a colocated actor's `reshard`, (name,
    tensor) pairs consumed lazily (a generator that gathers one parameter at a time keeps
    only that one alive);
  - `bucket(mapping, last=)`: a streamed update of a disaggregated reshard, one message's
    bucket at a time, `last` closing it.
Either way `begin`, any number of `feed`s and `end` run in order, and the sink says whether
the engine may sample (`ok`) and whether an update is half-way (`updating`): `ready(where)`
is the check every backend's generate makes. The metrics of a complete update are
`timing/reshard`, `reshard/bytes` and `reshard/tensors`.

InPlaceWeights consumes pairs named as `model.named_parameters(remove_duplicate=False)`
names them (a tied weight answers to both names). Aliasing (option): when a tensor already
has the parameter's shape, dtype and device and is contiguous, the parameter takes its
storage instead of a copy, so a colocated engine reads the actor's weights with no second
copy. The storage stays shared until the next update, and anything that captured the old
pointers (CUDA graphs) must be re-made: `replaced` says whether this update changed any
parameter's storage.

Invariants: a model is never sampled half-written (`ok` is False from the first tensor
of an update until its last bucket passes the completeness check, and stays False after
any error); unknown names and shape mismatches are BatchErrors naming the parameter.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from hybridflow.errors import BatchError
from hybridflow.stages.base import Metrics

Pairs = Iterable[tuple[str, torch.Tensor]]


class WeightSink:
    """One engine's weight updates: `begin`, `feed`s, `end` (subclasses), reached through
    `update` or `bucket`."""

    updating = False  # between an update's first tensor and its end
    ok = True  # the engine holds one complete update (False after any error)
    failed: type[BatchError] = BatchError  # what `ready` raises for a failed update

    def begin(self) -> None:
        raise NotImplementedError

    def feed(self, weights: Pairs) -> None:
        raise NotImplementedError

    def end(self) -> Metrics:
        raise NotImplementedError

    def update(self, weights: Pairs) -> Metrics:
        """One complete update from (name, tensor) pairs, consumed lazily."""
        self.begin()
        self.feed(weights)
        return self.end()

    def bucket(self, bucket: Mapping[str, torch.Tensor], *, last: bool) -> Metrics:
        """One bucket of a streamed update; the last one closes it."""
        if not isinstance(bucket, Mapping):
            raise BatchError(f"load_weights: bucket must be a mapping, got {type(bucket).__name__}")
        if not self.updating:
            self.begin()
        self.feed(bucket.items())
        if not last:
            return {"reshard/bucket_tensors": float(len(bucket))}
        return self.end()

    def ready(self, where: str) -> None:
        """Raise unless the engine may sample: no update half-way, the last one complete."""
        if self.updating:
            raise BatchError(
                f"{where}: a weight update is in progress (load_weights buckets sent without "
                "the `last` one)"
            )
        if not self.ok:
            raise self.failed(
                f"{where}: the last weight update failed or was incomplete; the engine holds "
                "mixed weights and will not generate until a complete update succeeds"
            )


class InPlaceWeights(WeightSink):
    """Writes each tensor into the engine model's parameter of that name (hf, native)."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], *, alias: bool = False) -> None:
        self.params = dict(params)  # every name the sender may use -> parameter
        self.alias = alias
        self.replaced = False
        self._unwritten: set[int] = set()
        self._bytes = self._tensors = 0
        self._t0 = 0.0

    def begin(self) -> None:
        self.updating, self.ok, self.replaced = True, False, False
        self._unwritten = {id(p) for p in self.params.values()}
        self._bytes = self._tensors = 0
        self._t0 = time.perf_counter()

    def feed(self, weights: Pairs) -> None:
        try:
            with torch.no_grad():
                for name, tensor in weights:
                    param = self.params.get(name)
                    if param is None:
                        known = list(self.params)[:4]
                        raise BatchError(f"load_weights: unknown parameter {name!r} (e.g. {known})")
                    if param.shape != tensor.shape:
                        raise BatchError(
                            f"load_weights: {name} is {tuple(tensor.shape)}, the model "
                            f"expects {tuple(param.shape)}"
                        )
                    self._write(param, tensor)
                    self._unwritten.discard(id(param))
                    self._bytes += tensor.numel() * tensor.element_size()
                    self._tensors += 1
        except BaseException:
            self.updating = False  # ok stays False: never sample mixed weights
            raise

    def _write(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
        same = (
            tensor.dtype == param.dtype and tensor.device == param.device and tensor.is_contiguous()
        )
        if self.alias and same:
            if tensor.data_ptr() != param.data_ptr():
                param.data = tensor.detach()
                self.replaced = True
        elif tensor.data_ptr() != param.data_ptr():
            param.copy_(tensor)  # casts dtype and moves device as needed

    def end(self) -> Metrics:
        self.updating = False
        if self._unwritten:
            raise incomplete(self.unwritten())
        self.ok = True
        return self.metrics()

    def unwritten(self) -> list[str]:
        """The names of the parameters this update has not written (yet)."""
        return [n for n, p in self.params.items() if id(p) in self._unwritten]

    def metrics(self) -> Metrics:
        return {
            "timing/reshard": time.perf_counter() - self._t0,
            "reshard/bytes": float(self._bytes),
            "reshard/tensors": float(self._tensors),
        }


def incomplete(missing: list[str]) -> BatchError:
    return BatchError(
        f"load_weights: incomplete update, {len(missing)} parameter(s) never received, "
        f"e.g. {missing[:4]}"
    )
