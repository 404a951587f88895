"""Reward shaping and sample filtering of DAPO (Yu et al. 2025, arXiv 2503.14476).

Consumes sequence `scores` [B], response `lengths` [B] (valid tokens per response) and
`group_index` [B] (the prompt id of each sample, as in advantages.py). Produces shaped
scores [B] and a per-sample keep mask [B]; never differentiated.

- Overlong reward shaping (DAPO eq. 13): a soft length penalty inside the last
  `buffer_len` tokens before the limit, added to the task reward:
      R_len(|y|) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                 = -1                                 if |y| > L_max
  scaled by `penalty_factor` (1 in the paper). A truncated answer is not punished as
  hard as a wrong one it may not be, and the policy learns to finish before the limit.
- Dynamic sampling's filter (DAPO sec. 3.2): a group whose rewards all agree (all
  right or all wrong) has zero advantage under any group baseline: it only dilutes the
  batch. `informative_groups` marks the samples of groups with nonzero reward variance.

Invariant: pure functions of their inputs; group ids need not be contiguous or sorted.
"""

from __future__ import annotations

import torch

from hybridflow.algos.utils import check_ndim
from hybridflow.errors import AlgorithmInputError


@torch.no_grad()
def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong penalty R_len [B] (<= 0) for response `lengths` [B]."""
    where = "overlong_penalty"
    check_ndim(where, "lengths", lengths, 1, "[B]")
    if not 0 < buffer_len <= max_len:
        raise AlgorithmInputError(
            f"{where}: need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, "
            f"max_len={max_len}"
        )
    if penalty_factor < 0:
        raise AlgorithmInputError(f"{where}: penalty_factor must be >= 0, got {penalty_factor}")
    n = lengths.float()
    expected = float(max_len - buffer_len)  # L_max - L_cache: no penalty up to here
    ramp = ((expected - n) / buffer_len).clamp(min=-1.0, max=0.0)  # 0 .. -1 over the buffer
    pen = torch.where(n > max_len, torch.full_like(n, -1.0), ramp)
    return penalty_factor * pen


@torch.no_grad()
def informative_groups(
    scores: torch.Tensor, group_index: torch.Tensor, atol: float = 0.0
) -> torch.Tensor:
    """Keep mask [B] (bool): samples whose group's scores are not all equal.

    `scores` [B], `group_index` [B] integer prompt ids. A group's spread is max - min of
    its scores; it is kept when the spread is > `atol` (0: any difference counts).
    """
    where = "informative_groups"
    check_ndim(where, "scores", scores, 1, "[B]")
    check_ndim(where, "group_index", group_index, 1, "[B]")
    if scores.shape != group_index.shape:
        raise AlgorithmInputError(
            f"{where}: `scores` has {scores.shape[0]} entries, `group_index` {group_index.shape[0]}"
        )
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise AlgorithmInputError(f"{where}: `group_index` must hold integer prompt ids")
    _, inverse = torch.unique(group_index, return_inverse=True)
    g = int(inverse.max()) + 1 if inverse.numel() else 0
    s = scores.float()
    hi = torch.full((g,), -torch.inf, device=s.device).scatter_reduce(0, inverse, s, "amax")
    lo = torch.full((g,), torch.inf, device=s.device).scatter_reduce(0, inverse, s, "amin")
    return ((hi - lo) > atol)[inverse]
