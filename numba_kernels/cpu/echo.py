"""The salient window echo of a prefill chunk in Numba: the twin of
:func:`sglang_tasq.salient.query_echo` (equal up to float order).

Each query at position ``t`` scores the exact keys the window rule gives it (``p <= t`` and
``p < sink`` or ``p >= t + 1 - recent``; :func:`sglang_tasq.windows.query_window`), takes the
softmax over those keys alone and sums the probability of the prompt's head ``[lo, hi)``
(:func:`sglang_tasq.salient.echo_span`) over the query heads of each KV head. The torch
reference runs blocks of 256 queries against every column any of them reads (a masked
[G * 256, ~576] matmul and softmax per KV head); here each query reads only its own
``<= sink + recent`` keys, each key row once for the G query heads of its KV head, parallel over
queries (~2x the torch echo on a 256-query chunk; most of the rest is the scalar ``exp``).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange


@njit(cache=True, inline="always")
def _first_at_least(cols, x):
    """First index of ascending ``cols`` whose value is >= x (len(cols) if none)."""
    a, b = 0, cols.shape[0]
    while a < b:
        m = (a + b) >> 1
        if cols[m] < x:
            a = m + 1
        else:
            b = m
    return a


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _query_echo(q, k, q_pos, cols, sink, recent, lo, hi, out):
    """q [c, Hq, d] f32 (scaled), k [m, H, d] f32 (keys at ascending positions ``cols`` [m]),
    q_pos [c] -> out [c, H] f32 (module docstring)."""
    c, Hq, d = q.shape
    H = k.shape[1]
    G = Hq // H
    for i in prange(c):
        t = q_pos[i]
        n1 = _first_at_least(cols, min(sink, t + 1))  # [0, n1): the sink keys up to t
        s1 = min(n1, _first_at_least(cols, hi))  # [s0, s1): the prompt's head, inside the sink keys
        s0 = min(s1, _first_at_least(cols, lo))
        r0 = _first_at_least(cols, max(sink, t + 1 - recent))  # [r0, r1): the recent window up to t
        r1 = max(r0, _first_at_least(cols, t + 1))  # empty while t < sink
        n = n1 + (r1 - r0)
        logit = np.empty((G, max(n, 1)), np.float32)
        mx = np.empty(G, np.float32)
        for h in range(H):
            mx[:] = -np.inf
            for j in range(n):  # each key row read once for the G query heads of its KV head
                jj = j if j < n1 else r0 + (j - n1)
                for g in range(G):
                    s = np.float32(0.0)
                    for e in range(d):
                        s += q[i, h * G + g, e] * k[jj, h, e]
                    logit[g, j] = s
                    mx[g] = max(mx[g], s)
            acc = np.float32(0.0)
            for g in range(G):
                span = np.float32(0.0)
                for j in range(s0, s1):
                    span += np.exp(logit[g, j] - mx[g])
                tot = span
                for j in range(s0):
                    tot += np.exp(logit[g, j] - mx[g])
                for j in range(s1, n):
                    tot += np.exp(logit[g, j] - mx[g])
                acc += span / tot
            out[i, h] = acc


def query_echo(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, cols: torch.Tensor, sink: int, recent: int,
               scale: float) -> torch.Tensor:
    """:func:`sglang_tasq.salient.query_echo` (same arguments: q [c, Hq, d] post-RoPE queries at
    ``q_pos`` [c], k [m, H, d] the exact post-RoPE keys at ascending ``cols`` [m], at least each
    query's sink and recent window) -> [c, H] f32, on the CPU."""
    from sglang_tasq.salient import echo_span

    if recent < 1:
        raise ValueError("the window echo needs recent >= 1 (a query reads itself)")
    c, Hq, d = q.shape
    if k.shape[0] != cols.shape[0] or Hq % k.shape[1] or k.shape[2] != d:
        raise ValueError(f"query_echo: q {tuple(q.shape)}, k {tuple(k.shape)}, cols {tuple(cols.shape)} do not fit")
    out = np.zeros((c, k.shape[1]), np.float32)
    if c:
        lo, hi = echo_span(sink)
        qs = (q.detach().float() * scale).cpu().contiguous().numpy()
        kk = k.detach().float().cpu().contiguous().numpy()
        _query_echo(qs, kk, q_pos.detach().cpu().to(torch.int64).contiguous().numpy(),
                    cols.detach().cpu().to(torch.int64).contiguous().numpy(), sink, recent, lo, hi, out)
    return torch.from_numpy(out)
