"""models/kernels.py's build probe: every Triton kernel of the project (decode, sampling,
the head's log-probs) is on by default on a GPU, so a machine where Triton cannot build a
kernel (no C compiler for its launcher) must fall back to the torch paths with one
warning, not fail inside a rollout or a training step.

The CPU build of torch has no Triton, so the probe's kernel is replaced at its seam
(`kernels._copy`) by stand-ins named for what they do; TRITON_INTERPRET=1 lets runs_on
consider the CPU, as it does for checks by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow.models import head_kernel, kernels
from hybridflow.models.head_logprobs import head_logprobs

CPU = torch.device("cpu")


class _Launch:
    """A stand-in for a @triton.jit function: kernel[grid](*args, **meta) calls `body`."""

    def __init__(self, body: Any) -> None:
        self.body, self.launches = body, 0

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **meta: Any) -> None:
            self.launches += 1
            self.body(*args)

        return launch


def _copies(x, y, n):
    y.copy_(x)


def _no_compiler(x, y, n):
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


@pytest.fixture
def probe(monkeypatch):
    """Arm the probe as if Triton were installed: a fresh answer cache, the CPU allowed."""
    monkeypatch.setattr(kernels, "TRITON", True)
    monkeypatch.setattr(kernels.builds, "answers", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def use(body: Any) -> _Launch:
        launch = _Launch(body)
        monkeypatch.setattr(kernels, "_copy", launch, raising=False)
        return launch

    return use


def test_a_machine_that_cannot_build_takes_the_torch_paths_with_one_warning(probe, caplog):
    launch = probe(_no_compiler)
    with caplog.at_level("WARNING", logger="hybridflow.models.kernels"):
        assert [kernels.runs_on(CPU) for _ in range(3)] == [False] * 3
    assert launch.launches == 1  # probed once, the answer kept
    (record,) = caplog.records
    assert "Failed to find C compiler" in record.message and "torch paths" in record.message


def test_a_kernel_that_builds_and_runs_is_used_without_a_word(probe, caplog):
    launch = probe(_copies)
    with caplog.at_level("WARNING", logger="hybridflow.models.kernels"):
        assert kernels.runs_on(CPU) and kernels.runs_on(CPU)
    assert launch.launches == 1 and not caplog.records


def test_a_probe_whose_result_is_wrong_counts_as_not_building(probe, caplog):
    probe(lambda x, y, n: y.zero_())
    with caplog.at_level("WARNING", logger="hybridflow.models.kernels"):
        assert not kernels.runs_on(CPU)
    assert "came back wrong" in caplog.records[0].message


def test_no_probe_is_launched_while_a_graph_is_being_compiled(probe, monkeypatch):
    """A first use inside a torch.compile trace (or a CUDA graph capture) must not launch
    the probe into it: the answer is yes, and nothing is kept, so the next eager call
    probes."""
    launch = probe(_no_compiler)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert kernels.runs_on(CPU)
    assert launch.launches == 0 and kernels.builds.answers == {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert not kernels.runs_on(CPU)


def test_without_triton_or_off_the_gpu_nothing_is_probed(probe, monkeypatch):
    launch = probe(_no_compiler)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels.runs_on(CPU)  # a CPU device without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "TRITON", False)
    assert not kernels.runs_on(CPU)
    assert launch.launches == 0


def test_the_head_log_probs_run_the_torch_passes_where_kernels_cannot_build(probe, monkeypatch):
    """End to end through a kernel user: with `kernel` on and the build failing, the head's
    log-probs and gradients are the torch passes' bit for bit, and the head kernel is
    never launched."""
    probe(_no_compiler)

    def never(*args: Any) -> Any:
        raise AssertionError("the head kernel ran where Triton cannot build")

    monkeypatch.setattr(head_kernel, "stats", never)
    monkeypatch.setattr(head_kernel, "grad", never)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 30)
    hidden = torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 30, (11,), generator=g)
    out = []
    for kernel in (True, False):
        h = hidden.clone().requires_grad_(True)
        lp, ent = head_logprobs(h, targets, head, chunk_tokens=4, with_entropy=True, kernel=kernel)
        (lp.sum() + ent.sum()).backward()
        out.append((lp.detach(), ent.detach(), h.grad))
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)
