"""Held-out reconstruction errors of a set of codebooks, for the calibration summary and tests.

* key MSE: ``||k - k_hat||^2 / ||k||^2`` on pre-RoPE keys (native channels);
* attention-logit NMSE: over random causal pairs (t >= p) of the held-out windows,
  ``sum (q_t . R_p (k_p - k_hat_p))^2 / sum (q_t . R_p k_p)^2`` with post-RoPE queries;
  computed as ``u . delta`` with ``u = R_{t-p} q~_t`` (see :mod:`calibrate.weights`);
* value MSE: ``||v - v_hat||^2 / ||v||^2``.

Post-RoPE quantizers (NovaKV, ``key_rope == 'post'``) code the keys rotated to their position
in the window; their reconstruction is turned back before RoPE, so every figure is in the same
(pre-RoPE) frame, and RoPE is norm-preserving, so the key MSE is the post-RoPE one too.
"""
from __future__ import annotations

import torch

from sglang_tasq import codec
from sglang_tasq.rope import apply_rope


def layer_errors(cb: codec.Codebooks, layer: int, keys: torch.Tensor, values: torch.Tensor,
                 queries: torch.Tensor | None, window: int, pairs: int = 8192, seed: int = 0,
                 attention_scaling: float = 1.0) -> dict:
    """keys/values [N, H, d], queries [N, Hq, d] pre-RoPE, N a multiple of ``window``."""
    k = keys.float()
    if cb.config.key_rope == "post":
        pos = torch.arange(k.shape[0]) % window
        k_post = apply_rope(k, pos, cb.inv_freq, attention_scaling)
        codes, scale = codec.encode_keys(k_post, cb, layer)
        k_hat = apply_rope(codec.decode_keys(codes, scale, cb, layer), pos, cb.inv_freq, attention_scaling,
                           inverse=True)
    else:
        codes, scale = codec.encode_keys(k, cb, layer)
        k_hat = codec.decode_keys(codes, scale, cb, layer)
    v = values.float()
    v_hat = codec.decode_values(codec.encode_values(v, cb, layer), cb, layer)
    out = {
        "key_mse": float(((k - k_hat) ** 2).sum() / (k ** 2).sum()),
        "value_mse": float(((v - v_hat) ** 2).sum() / (v ** 2).sum()),
    }
    if queries is not None:
        out["logit_nmse"] = logit_nmse(queries.float(), k, k_hat, cb.inv_freq, window, pairs, seed)
    return out


def logit_nmse(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, inv_freq: torch.Tensor,
               window: int, pairs: int, seed: int) -> float:
    """Relative squared logit error over ``pairs`` causal pairs sampled uniformly per window."""
    N, Hq, d = q.shape
    H = k.shape[1]
    gen = torch.Generator().manual_seed(seed)
    n_win = N // window
    w = torch.randint(0, n_win, (pairs,), generator=gen)
    t = torch.multinomial(torch.arange(1, window + 1, dtype=torch.float64), pairs, replacement=True, generator=gen)
    p = (torch.rand(pairs, generator=gen) * (t + 1).double()).long().clamp_max(t)
    u = apply_rope(q[w * window + t], t - p, inv_freq)  # [pairs, Hq, d]
    rep = Hq // H
    kk = k[w * window + p].repeat_interleave(rep, dim=1)
    dk = (k - k_hat)[w * window + p].repeat_interleave(rep, dim=1)
    logit = (u * kk).sum(-1)
    err = (u * dk).sum(-1)
    return float((err ** 2).sum() / (logit ** 2).sum())
