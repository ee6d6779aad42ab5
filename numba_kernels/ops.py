"""Launch wrappers of the TaSQ kernels: check inputs, pick kernels, launch on torch's stream.

On a GPU, tensors go to Numba through ``__cuda_array_interface__`` (bf16 as an int16 view)
and kernels run on ``torch.cuda.current_stream()``; in the simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same code takes CPU tensors and passes ``.numpy()`` views,
which the kernels write in place. References with the same signatures: :mod:`.reference`.

What the caller does itself: the full-precision window copies (``k_full[loc] = k`` with a
plain ``index_copy_``); keys in ``k_full`` are PRE-RoPE (native order) and rotated in-kernel.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import attention, encode, extend
from .devfns import SIM
from .tables import LayerTables

_DTYPE_KIND = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_LOC_TYPE = {torch.int64: "int64", torch.int32: "int32"}
_streams: dict = {}


def _kind(t: torch.Tensor, name: str) -> str:
    if t.dtype not in _DTYPE_KIND:
        raise TypeError(f"{name}: dtype {t.dtype}, allowed float32/float16/bfloat16")
    return _DTYPE_KIND[t.dtype]


def _arr(t: torch.Tensor):
    """Kernel argument for tensor t (bf16 travels as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy() if SIM else t


def _launch(spec, grid, block, *args):
    if SIM:
        spec.kernel[grid, block](*args)
        return
    from numba import cuda

    ptr = torch.cuda.current_stream().cuda_stream
    if ptr not in _streams:
        _streams[ptr] = cuda.external_stream(ptr)
    spec.kernel[grid, block, _streams[ptr]](*args)


def _check(t: torch.Tensor, name: str, shape=None, dtype=None):
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_pool(tables: LayerTables, k_codes, v_codes, k_scale):
    S = k_codes.shape[0]
    _check(k_codes, "k_codes", (S, tables.k_row_bytes), torch.uint8)
    _check(v_codes, "v_codes", (S, tables.v_row_bytes), torch.uint8)
    mode = tables.config.scale
    want = {"shared": (S,), "per_head": (S, tables.num_kv_heads)}.get(mode)
    _check(k_scale, "k_scale", want, torch.float16)


def encode_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, tables: LayerTables,
              k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor) -> None:
    """Encode pre-RoPE keys k [T, H, d] and values v [T, H, d] into pool slots loc [T].

    k, v: float32/float16/bfloat16; loc int64/int32. Writes k_codes/v_codes uint8
    [S, row bytes] (one packed row per token, all heads: code n = h * G + j) and k_scale
    fp16 [S] (scale "shared") or [S, H] ("per_head"); untouched for "none".
    """
    cfg = tables.config
    T, H, d = k.shape
    if T == 0:
        return
    _check(k, "k", (T, tables.num_kv_heads, tables.head_dim))
    _check(v, "v", (T, H, d))
    _check(loc, "loc", (T,))
    if loc.dtype not in _LOC_TYPE:
        raise TypeError(f"loc: dtype {loc.dtype}, allowed int64/int32")
    _check_pool(tables, k_codes, v_codes, k_scale)
    kk, vk, lt = _kind(k, "k"), _kind(v, "v"), _LOC_TYPE[loc.dtype]
    gk, gv = cfg.group_size_k, cfg.group_size_v
    Kk, Kv = tables.k_tcb.shape[2], tables.v_tcb.shape[2]
    Gk, Gv = d // gk, d // gv
    kc = torch.empty(T, H * Gk, dtype=torch.int32, device=k.device)
    vc = torch.empty(T, H * Gv, dtype=torch.int32, device=k.device)
    a_loc, a_scale = _arr(loc), _arr(k_scale)
    if cfg.scale != "none":
        per_head = cfg.scale == "per_head"
        spec = encode.scale_kernel(H, d, kk, per_head, lt)
        _launch(spec, (T, H if per_head else 1), encode.NT, _arr(k), _arr(tables.k_weight), a_loc, a_scale)
    tiles = (T + encode.NT - 1) // encode.NT
    spec = encode.argmin_kernel(H, d, gk, Kk, kk, True, cfg.scale, lt)
    _launch(spec, (H * Gk, tiles), encode.NT, _arr(k), _arr(tables.k_weight), _arr(tables.k_perm), a_loc,
            a_scale, _arr(tables.k_tcb), _arr(tables.k_tnorm), _arr(kc))
    spec = encode.argmin_kernel(H, d, gv, Kv, vk, False, cfg.scale, lt)
    _launch(spec, (H * Gv, tiles), encode.NT, _arr(v), _arr(tables.k_weight), _arr(tables.k_perm), a_loc,
            a_scale, _arr(tables.v_tcb), _arr(tables.v_tnorm), _arr(vc))
    spec = encode.pack_kernel(H * Gk, cfg.code_bits_k, H * Gv, cfg.code_bits_v, lt)
    _launch(spec, (T,), encode.NT, _arr(kc), _arr(vc), a_loc, _arr(k_codes), _arr(v_codes))


def _permuted_queries(q: torch.Tensor, tables: LayerTables) -> torch.Tensor:
    """q [N, Hq, d] -> f32 [N, Hq, d], head hq gathered by k_perm of KV head hq // rep."""
    N, Hq, d = q.shape
    rep = Hq // tables.num_kv_heads
    perm = tables.k_perm.long().repeat_interleave(rep, 0)
    return torch.gather(q.float(), 2, perm.unsqueeze(0).expand(N, Hq, d)).contiguous()


def _common(q, tables, k_codes, v_codes, k_scale, kv_indptr, kv_indices, k_full, v_full, sink, recent,
            full: bool = False):
    """Checks shared by the attention wrappers -> (k_full kind, k_full, v_full); ``full``: the
    exact copies are read even without windows (kept slots)."""
    H, d = tables.num_kv_heads, tables.head_dim
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % H:
        raise ValueError(f"q: shape {tuple(q.shape)}, expected [N, Hq, {d}] with Hq a multiple of H={H}")
    _kind(q, "q")
    _check_pool(tables, k_codes, v_codes, k_scale)
    _check(kv_indptr, "kv_indptr", dtype=torch.int32)
    _check(kv_indices, "kv_indices", dtype=torch.int32)
    if sink < 0 or recent < 0:
        raise ValueError(f"sink={sink}, recent={recent}: must be >= 0")
    if sink + recent > 0 or full:
        if k_full is None or v_full is None:
            raise ValueError("sink/recent windows need k_full and v_full [S, H, d]")
        S = k_codes.shape[0]
        _check(k_full, "k_full", (S, H, d))
        _check(v_full, "v_full", (S, H, d), k_full.dtype)
        fkind = _kind(k_full, "k_full")
    else:
        fkind = "f16"
        k_full = v_full = torch.zeros(1, 1, 1, dtype=torch.float16, device=q.device)
    return fkind, k_full, v_full


def _scale_arg(k_scale, tables):
    return k_scale if tables.config.scale != "none" else k_scale.reshape(-1)[:1].contiguous()


def default_split_len(batch_rows: int, H: int, max_kv_len: int, nt: int, lmax: int, target_blocks: int = 528) -> int:
    """Tokens per split: enough blocks to fill the GPU, at most ``lmax``, a multiple of ``nt``."""
    per_seq = max(1, target_blocks // max(1, batch_rows * H))
    split = math.ceil(max(1, max_kv_len) / per_seq)
    return int(min(lmax, max(nt, math.ceil(split / nt) * nt)))


def decode_attention(q: torch.Tensor, k_codes, v_codes, k_scale, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     tables: LayerTables, sm_scale: float, k_full=None, v_full=None, sink: int = 0,
                     recent: int = 0, out: Optional[torch.Tensor] = None, max_kv_len: Optional[int] = None,
                     split_len: Optional[int] = None, kept: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Single-token queries q [B, Hq, d] (post-RoPE) over the compressed cache -> out [B, Hq, d] f32.

    kv_indptr i32 [B+1], kv_indices i32 [total]: request b's slots in position order.
    Windows (sink/recent > 0) read pre-RoPE k_full and v_full [S, H, d]; so do the slots with
    ``kept[slot] != 0`` (u8 [S], salient tokens; needs k_full/v_full). For CUDA graphs pass
    ``max_kv_len`` (an upper bound; otherwise it is read from kv_indptr with a host sync)
    and a fixed ``split_len``.
    """
    B, Hq, d = q.shape
    H = tables.num_kv_heads
    if kept is not None:
        if k_full is None or v_full is None:
            raise ValueError("kept slots are read from k_full and v_full [S, H, d]: pass them")
        _check(kept, "kept", (k_codes.shape[0],), torch.uint8)
    fkind, k_full, v_full = _common(q, tables, k_codes, v_codes, k_scale, kv_indptr, kv_indices,
                                    k_full, v_full, sink, recent, full=kept is not None)
    rep = Hq // H
    cfg = tables.config
    nt, lmax = attention.plan(rep, 1, cfg.group_size_v, d)
    if max_kv_len is None:
        max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max()) if B else 0
    split_len = split_len or default_split_len(B, H, max_kv_len, nt, lmax)
    if not (1 <= split_len <= lmax):
        raise ValueError(f"split_len={split_len}: allowed 1..{lmax}")
    ns = max(1, math.ceil(max_kv_len / split_len))
    if out is None:
        out = torch.empty(B, Hq, d, dtype=torch.float32, device=q.device)
    _check(out, "out", (B, Hq, d), torch.float32)
    if B == 0:
        return out
    part_acc = torch.empty(B, Hq, ns, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B, Hq, ns, 2, dtype=torch.float32, device=q.device)
    spec = attention.cache_kernel(H, d, cfg.group_size_k, tables.k_cb.shape[2], cfg.code_bits_k, cfg.group_size_v,
                                  tables.v_cb.shape[2], cfg.code_bits_v, rep, 1, cfg.scale, fkind,
                                  has_kept=kept is not None)
    dummy = torch.zeros(1, 3, dtype=torch.int32, device=q.device)
    kept_arg = kept.contiguous() if kept is not None else torch.zeros(1, dtype=torch.uint8, device=q.device)
    _launch(spec, (ns, H, B), nt, _arr(_permuted_queries(q, tables)), _arr(k_codes), _arr(v_codes),
            _arr(_scale_arg(k_scale, tables)), _arr(k_full), _arr(v_full), _arr(kv_indptr), _arr(kv_indices),
            _arr(dummy), _arr(tables.k_cb), _arr(tables.v_cb), _arr(tables.rope_freq), _arr(tables.k_perm),
            _arr(kept_arg), split_len, sink, recent, sm_scale * tables.attention_scaling, _arr(part_acc), _arr(part_ml))
    red = attention.reduce_kernel(d, False, False)
    _launch(red, (B, Hq), d, _arr(part_acc), _arr(part_ml), _arr(kv_indptr), _arr(dummy[0]), split_len, _arr(out))
    return out


def extend_attention(q: torch.Tensor, k_chunk: torch.Tensor, v_chunk: torch.Tensor, qo_indptr: torch.Tensor,
                     k_codes, v_codes, k_scale, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     tables: LayerTables, sm_scale: float, k_full=None, v_full=None, sink: int = 0,
                     recent: int = 0, out: Optional[torch.Tensor] = None,
                     split_len: Optional[int] = None) -> torch.Tensor:
    """Causal extend: rows q [N, Hq, d] over their compressed prefix plus their own chunk.

    k_chunk/v_chunk [N, H, d] (keys post-RoPE, as SGLang gives them; float32/float16/bf16,
    same dtype); qo_indptr i32 [B+1]; the prefix of request b (P_b tokens) is
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] with windows over n = P_b. Chunk row i of
    request b sits at position P_b + i. Reads qo_indptr/kv_indptr on the host (not for
    graph capture). Returns out [N, Hq, d] f32.
    """
    N, Hq, d = q.shape
    H = tables.num_kv_heads
    fkind, k_full, v_full = _common(q, tables, k_codes, v_codes, k_scale, kv_indptr, kv_indices,
                                    k_full, v_full, sink, recent)
    _check(k_chunk, "k_chunk", (N, H, d))
    _check(v_chunk, "v_chunk", (N, H, d), k_chunk.dtype)
    _check(qo_indptr, "qo_indptr", (kv_indptr.numel(),), torch.int32)
    ckind = _kind(k_chunk, "k_chunk")
    if out is None:
        out = torch.empty(N, Hq, d, dtype=torch.float32, device=q.device)
    _check(out, "out", (N, Hq, d), torch.float32)
    if N == 0:
        return out
    rep, cfg = Hq // H, tables.config
    QT = max(1, 8 // rep)
    nt, lmax = attention.plan(rep, QT, cfg.group_size_v, d)
    qo, kvp = qo_indptr.cpu().tolist(), kv_indptr.cpu().tolist()
    tiles, row_req = [], []
    for b in range(len(qo) - 1):
        row_req += [b] * (qo[b + 1] - qo[b])
        tiles += [(b, r, min(QT, qo[b + 1] - r)) for r in range(qo[b], qo[b + 1], QT)]
    max_p = max(kvp[b + 1] - kvp[b] for b in range(len(kvp) - 1))
    split_len = split_len or default_split_len(len(tiles), H, max_p, nt, lmax)
    if not (1 <= split_len <= lmax):
        raise ValueError(f"split_len={split_len}: allowed 1..{lmax}")
    ns = math.ceil(max_p / split_len)
    part_acc = torch.empty(N, Hq, ns + 1, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(N, Hq, ns + 1, 2, dtype=torch.float32, device=q.device)
    row_req_t = torch.tensor(row_req, dtype=torch.int32, device=q.device)
    if ns > 0:
        qtiles = torch.tensor(tiles, dtype=torch.int32, device=q.device).view(-1, 3)
        spec = attention.cache_kernel(H, d, cfg.group_size_k, tables.k_cb.shape[2], cfg.code_bits_k,
                                      cfg.group_size_v, tables.v_cb.shape[2], cfg.code_bits_v, rep, QT, cfg.scale, fkind,
                                      tiled=True)
        _launch(spec, (ns, H, len(tiles)), nt, _arr(_permuted_queries(q, tables)), _arr(k_codes), _arr(v_codes),
                _arr(_scale_arg(k_scale, tables)), _arr(k_full), _arr(v_full), _arr(kv_indptr), _arr(kv_indices),
                _arr(qtiles), _arr(tables.k_cb), _arr(tables.v_cb), _arr(tables.rope_freq), _arr(tables.k_perm),
                _arr(torch.zeros(1, dtype=torch.uint8, device=q.device)), split_len, sink, recent,
                sm_scale * tables.attention_scaling, _arr(part_acc), _arr(part_ml))
    spec = extend.chunk_kernel(d, rep, ckind)
    _launch(spec, (N, H), d, _arr(q.float().contiguous()), _arr(k_chunk), _arr(v_chunk), _arr(row_req_t),
            _arr(qo_indptr), sm_scale, _arr(part_acc), _arr(part_ml))
    red = attention.reduce_kernel(d, True, True)
    _launch(red, (N, Hq), d, _arr(part_acc), _arr(part_ml), _arr(kv_indptr), _arr(row_req_t), split_len, _arr(out))
    return out
