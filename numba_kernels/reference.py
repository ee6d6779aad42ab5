"""Plain-torch references of the kernels, with the kernels' signatures (see :mod:`.ops`).

Every function is built from :mod:`sglang_tasq.codec` (encode_keys, encode_values,
pack_codes, unpack_codes, attention_over_codes) on the one-layer Codebooks of
:meth:`LayerTables.codebooks`, so the kernels are tested against the codec's math, not a
second derivation of it. Slow (per-request Python loops); for tests only.
"""
from __future__ import annotations

from typing import Optional

import torch

from sglang_tasq import codec, packing, windows
from sglang_tasq.rope import apply_rope

from .tables import LayerTables


def encode_kv_ref(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, tables: LayerTables,
                  k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor) -> None:
    """Encode pre-RoPE keys k [T, H, d] and values v [T, H, d] into pool slots ``loc`` [T].

    Writes k_codes[loc] (uint8 [S, kb]), v_codes[loc] (uint8 [S, vb]) and, unless the scale
    mode is "none", k_scale[loc] (fp16 [S] or [S, H]).
    """
    cb, cfg = tables.codebooks(), tables.config
    T, H, _ = k.shape
    kc, scale = codec.encode_keys(k.float().cpu(), cb, 0)
    vc = codec.encode_values(v.float().cpu(), cb, 0)
    idx = loc.long().to(k_codes.device)
    k_codes[idx] = packing.pack_codes(kc.view(T, -1), cfg.code_bits_k).to(k_codes.device)
    v_codes[idx] = packing.pack_codes(vc.view(T, -1), cfg.code_bits_v).to(v_codes.device)
    if scale is not None:
        k_scale[idx] = scale.to(k_scale.device)


def _request_cache(tables, cb, slots, k_codes, v_codes, k_scale):
    """Unpacked codes [n, H, G] and scales of the cached tokens at ``slots``."""
    cfg, H = tables.config, tables.num_kv_heads
    n = slots.numel()
    kc = packing.unpack_codes(k_codes[slots].cpu(), H * tables.k_groups, cfg.code_bits_k).view(n, H, tables.k_groups)
    vc = packing.unpack_codes(v_codes[slots].cpu(), H * tables.v_groups, cfg.code_bits_v).view(n, H, tables.v_groups)
    scale = None if cfg.scale == "none" else k_scale[slots].cpu()
    return kc, vc, scale


def _window_mask(n: int, sink: int, recent: int) -> torch.Tensor:
    """Keys of a length-``n`` request read exactly by its last query (:func:`windows.in_window`)."""
    return windows.in_window(torch.arange(n), n, sink, recent)


def decode_attention_ref(q, k_codes, v_codes, k_scale, kv_indptr, kv_indices, tables: LayerTables,
                         sm_scale: float, k_full=None, v_full=None, sink: int = 0, recent: int = 0,
                         out: Optional[torch.Tensor] = None, kept=None) -> torch.Tensor:
    """Single-token queries q [B, Hq, d] (post-RoPE) over each request's compressed cache.

    Request b's tokens are the slots kv_indices[kv_indptr[b]:kv_indptr[b+1]], token i at
    RoPE position i; its first ``sink`` and last ``recent`` tokens, and every slot with
    ``kept[slot] != 0`` (salient tokens), read pre-RoPE k_full and v_full [S, H, d]. Returns
    out [B, Hq, d] f32 (zeros for an empty request).
    """
    cb = tables.codebooks()
    B, Hq, d = q.shape
    res = torch.zeros(B, Hq, d)
    ptr = kv_indptr.long().cpu()
    for b in range(B):
        slots = kv_indices[ptr[b] : ptr[b + 1]].long()
        n = slots.numel()
        if n == 0:
            continue
        kc, vc, scale = _request_cache(tables, cb, slots, k_codes, v_codes, k_scale)
        mask, kf, vf = None, None, None
        if sink + recent > 0 or kept is not None:
            mask = _window_mask(n, sink, recent)
            if kept is not None:
                mask = mask | (kept[slots].cpu() != 0)
            kf, vf = k_full[slots].float().cpu(), v_full[slots].float().cpu()
        pos = torch.arange(n)
        res[b] = codec.attention_over_codes(q[b : b + 1].float().cpu(), pos[-1:], kc, scale, vc, pos, cb, 0,
                                            sm_scale, causal=False, k_full=kf, v_full=vf, full_mask=mask)[0]
    if out is None:
        return res.to(q.device)
    out.copy_(res)
    return out


def extend_attention_ref(q, k_chunk, v_chunk, qo_indptr, k_codes, v_codes, k_scale, kv_indptr, kv_indices,
                         tables: LayerTables, sm_scale: float, k_full=None, v_full=None, sink: int = 0,
                         recent: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of a chunk of new tokens over a compressed prefix plus the chunk.

    q [N, Hq, d] post-RoPE, k_chunk [N, H, d] post-RoPE, v_chunk [N, H, d]; request b owns
    rows qo_indptr[b]:qo_indptr[b+1] and the prefix slots kv_indices[kv_indptr[b]:
    kv_indptr[b+1]] (P_b tokens, windows as in :func:`decode_attention_ref` with n = P_b).
    Chunk token i sits at position P_b + i. Returns out [N, Hq, d] f32.
    """
    cb = tables.codebooks()
    N, Hq, d = q.shape
    H = tables.num_kv_heads
    res = torch.zeros(N, Hq, d)
    qp, kp = qo_indptr.long().cpu(), kv_indptr.long().cpu()
    for b in range(qp.numel() - 1):
        q0, q1 = int(qp[b]), int(qp[b + 1])
        if q1 == q0:
            continue
        slots = kv_indices[kp[b] : kp[b + 1]].long()
        P, C = slots.numel(), q1 - q0
        kc, vc, scale = _request_cache(tables, cb, slots, k_codes, v_codes, k_scale)
        pos = torch.arange(P + C)
        # Chunk keys enter as a full-precision "window": turned back to pre-RoPE for the codec.
        kch = apply_rope(k_chunk[q0:q1].float().cpu(), pos[P:], cb.inv_freq, cb.attention_scaling, inverse=True)
        kf = torch.zeros(P + C, H, d)
        vf = torch.zeros(P + C, H, d)
        mask = torch.zeros(P + C, dtype=torch.bool)
        if sink + recent > 0 and P > 0:
            mask[:P] = _window_mask(P, sink, recent)
            kf[:P], vf[:P] = k_full[slots].float().cpu(), v_full[slots].float().cpu()
        kf[P:], vf[P:], mask[P:] = kch, v_chunk[q0:q1].float().cpu(), True
        zk = torch.zeros(C, H, kc.shape[2], dtype=torch.int64)
        zv = torch.zeros(C, H, vc.shape[2], dtype=torch.int64)
        sc = None if scale is None else torch.cat([scale, torch.ones((C,) + scale.shape[1:], dtype=scale.dtype)])
        res[q0:q1] = codec.attention_over_codes(q[q0:q1].float().cpu(), pos[P:], torch.cat([kc, zk]), sc,
                                                torch.cat([vc, zv]), pos, cb, 0, sm_scale, causal=True,
                                                k_full=kf, v_full=vf, full_mask=mask)
    if out is None:
        return res.to(q.device)
    out.copy_(res)
    return out
