"""Salient tokens kept exact: which coded tokens a request reads at full precision besides its
windows (issue 14), and what that costs in bits. Plain torch, the one reference.

The rule (SnapKV-style, chosen at a selection point ``T``: the end of the prompt, or the end of
the part of it seen before the question): the attention probabilities of the last ``obs``
queries before ``T`` over the keys *as served* (exact inside the windows, decoded codes
elsewhere: what a server can compute without exact keys for a cached prefix) are summed over
those queries and over the query heads of each KV head, max-pooled over ``pool`` neighbouring
positions (a needle is a few tokens: its neighbours come with it), and the ``budget`` best
positions per (layer, KV head) among the candidates are kept. The candidates are the tokens the
query at ``T - 1`` reads from codes: ``sink <= p < T - recent``. Every query after the selection
point reads a kept (position, head) exactly, in addition to the window rule of
:mod:`sglang_tasq.windows`. Ties go to the lower position. A token inside the recent window at
the selection point is no candidate: it is exact then, and moves to its codes as generation
pushes it out of the window (only for generations longer than ``recent``).

Bits: a kept (token, head) stores its key and value at 16 bits and one 4-byte position, on top
of its codes (kept so the selection can change without re-encoding): over a prompt of ``T``
tokens that adds ``budget / T * (16 + 16 / d)`` bits per element on each side.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

POSITION_BITS = 32  # one int32 position per kept (token, KV head), shared by its key and value


@dataclass(frozen=True)
class SalientSpec:
    """``budget`` kept positions per (layer, KV head); ``obs`` observation queries; ``pool``
    the max-pool width (odd)."""

    budget: int
    obs: int = 32
    pool: int = 7

    def __post_init__(self):
        if self.budget < 0 or self.obs < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"salient spec needs budget >= 0, obs >= 1 and an odd pool >= 1, got {self}")


def candidates(T: int, sink: int, recent: int) -> tuple[int, int]:
    """[lo, hi): the positions the query at ``T - 1`` reads from codes (empty: lo >= hi)."""
    return min(sink, T), max(min(sink, T), T - recent)


def token_scores(probs: torch.Tensor, pool: int) -> torch.Tensor:
    """probs [H, G, w, T] (softmax rows of w observation queries of each of the G query heads
    sharing a KV head) -> [H, T] summed attention, max-pooled over ``pool`` positions."""
    s = probs.float().sum((1, 2))  # [H, T]
    if pool > 1:
        s = torch.nn.functional.max_pool1d(s[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    return s


def select(probs: torch.Tensor, sink: int, recent: int, spec: SalientSpec) -> torch.Tensor:
    """[H, B] kept positions (ascending per head), B = min(budget, candidates), chosen from the
    observation probabilities ``probs`` [H, G, w, T] of a selection point at ``T``."""
    H, T = probs.shape[0], probs.shape[-1]
    lo, hi = candidates(T, sink, recent)
    B = max(0, min(spec.budget, hi - lo))
    if B == 0:
        return torch.empty(H, 0, dtype=torch.long)
    s = token_scores(probs, spec.pool)[:, lo:hi]
    order = torch.sort(-s, dim=1, stable=True).indices[:, :B]  # stable: ties to the lower position
    return torch.sort(order + lo, dim=1).values


def kept_mask(kept: torch.Tensor, T: int) -> torch.Tensor:
    """[H, T] bool: position p of head h is kept exact."""
    m = torch.zeros(kept.shape[0], T, dtype=torch.bool)
    return m.scatter_(1, kept.long(), True) if kept.numel() else m


def side_bits(budget: int, T: int, head_dim: int) -> float:
    """Bits per element each side (keys, values) spends on kept tokens over a prompt of T."""
    return min(budget, T) / T * (16 + POSITION_BITS / 2 / head_dim)


def window_bits(sink: int, recent: int, T: int) -> float:
    """Bits per element each side the exact windows add over a prompt of T tokens (16-bit copies)."""
    return min(sink + recent, T) / T * 16
