"""Split-K attention of query rows over a TaSQ-compressed cache, and the split reduction.

``cache_kernel``: block (split s, KV head h, query tile) handles up to ``split_len``
consecutive cached tokens of one request for R = QT * rep query rows (QT query tokens of the
tile, rep query heads per KV head). Group-major, so each group's fp16 codebook sits in shared
memory while it is used (numba.md, "Sizing the decode kernel"):

* key pass: for each key group j, stage codebook (h, j); each thread owns tokens
  ``t0 + tid + k * NT``, gathers its codeword times the token's scale (or the pre-RoPE
  full-precision key for window tokens), rotates the group's RoPE pairs at position t
  (permuted in-group rotate-half layout, angles advanced by a per-thread recurrence seeded
  with ``precise_sincos``) and adds the dot with each permuted query row to a shared logit.
* softmax over the split (fp32): per-row max and sum of exp, kept for the reduction.
* value pass: for each value group j, stage codebook (h, j); each thread accumulates
  ``p * codeword`` of its tokens for all R rows x gv channels, then a shared-memory
  reduction writes the split's unnormalised output for channels ``j*gv .. j*gv+gv-1``.

Window rule: token i of a request holding n cached tokens reads k_full/v_full (pre-RoPE,
native order, [S, H, d]) when ``i < sink`` or ``i >= n - recent``; its key is rotated
in-kernel exactly like a decoded one. With ``kept`` (salient tokens, issue 14), token i also reads
k_full/v_full when ``kept[slot] != 0`` (u8 [S], indexed like k_full by slot). ``reduce_kernel``
merges the splits (and, for extend, the chunk partial stored at split index NS - 1) into
out [rows, Hq, d].
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

from .devfns import KINDS, exp32, loader, precise_sincos, unpack
from .encode import KernelSpec

F16 = cuda.types.float16
SHARED_CB_HALVES = 8192  # fp16 codebook staged per group (16 KB); larger codebooks read global
SHARED_BUDGET = 31 * 1024  # bytes for logits + reduction + query rows (+16 KB codebook < 48 KB)


def plan(rep: int, QT: int, gv: int, d: int) -> tuple[int, int]:
    """(threads per block NT, max tokens per split LMAX) for R = QT * rep rows."""
    R = QT * rep
    O = R * gv
    nt = 128
    while nt > 32 and nt * (O + 1) * 4 > SHARED_BUDGET // 2:
        nt //= 2
    left = SHARED_BUDGET - nt * (O + 1) * 4 - R * d * 4 - 4 * max(nt, O)
    lmax = max(nt, (left // (4 * R)) // nt * nt)
    return nt, lmax


@functools.lru_cache(maxsize=None)
def cache_kernel(H: int, d: int, gk: int, Kk: int, kbits: int, gv: int, Kv: int, vbits: int, rep: int, QT: int,
                 scale_mode: str, full_kind: str, tiled: bool = False, has_kept: bool = False) -> KernelSpec:
    """Grid (num_splits, H, num_tiles), block NT (see :func:`plan`).

    qp f32 [NQ, Hq, d] (each KV head's rows in its permuted order), k_codes u8 [S, kb],
    v_codes u8 [S, vb], k_scale fp16 [S] / [S, H] / [1], k_full/v_full [S, H, d] (full_kind),
    kv_indptr i32 [B+1], kv_indices i32, qtiles i32 [tiles, 3] (request, first row, rows;
    read when ``tiled``, else tile = request = row and QT must be 1), k_cb fp16 [H, Gk, Kk, gk], v_cb fp16
    [H, Gv, Kv, gv], freq f32 [H, Gk, gk/2], perm i32 [H, d], kept u8 [S] (read when ``has_kept``,
    else any [1]), split_len, sink, recent, logit_scale -> part_acc f32 [NQ, Hq, NS, d],
    part_ml f32 [NQ, Hq, NS, 2].
    """
    Gk, Gv, HALF = d // gk, d // gv, gk // 2
    R = QT * rep
    O = R * gv
    NT, LMAX = plan(rep, QT, gv, d)
    ldf = loader(full_kind)
    stage_k = Kk * gk <= SHARED_CB_HALVES
    stage_v = Kv * gv <= SHARED_CB_HALVES
    CBK = Kk * gk if stage_k else 1
    CBV = Kv * gv if stage_v else 1
    CB = max(CBK, CBV)
    use_scale = scale_mode != "none"
    per_head = scale_mode == "per_head"
    RED = NT * (O + 1)
    P = max(1, NT // O)  # parts of the two-stage value reduction
    RED2 = max(NT, O * P)
    QS = R * d
    LG = LMAX * R
    fNT = float32(NT)
    ninf = float32(-math.inf)

    def kern(qp, k_codes, v_codes, k_scale, k_full, v_full, kv_indptr, kv_indices, qtiles, k_cb, v_cb,
             freq, perm, kept, split_len, sink, recent, logit_scale, part_acc, part_ml):
        s = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tile = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        if not tiled:
            req = tile
            row0 = tile
            nrows = 1
        else:
            req = qtiles[tile, 0]
            row0 = qtiles[tile, 1]
            nrows = qtiles[tile, 2]
        start = kv_indptr[req]
        n = kv_indptr[req + 1] - start
        t0 = s * split_len
        if t0 >= n:
            return
        t1 = min(n, t0 + split_len)
        cnt = t1 - t0
        win_hi = n - recent
        qs = cuda.shared.array(QS, float32)
        lg = cuda.shared.array(LG, float32)
        red = cuda.shared.array(RED, float32)
        cbk = cuda.shared.array(CB, F16)  # key codebook, then value codebook
        cbv = cbk
        stat = cuda.shared.array(R, float32)
        red2 = cuda.shared.array(RED2, float32)
        x = cuda.local.array(gk, float32)
        cc = cuda.local.array(HALF, float32)
        ss = cuda.local.array(HALF, float32)
        dc = cuda.local.array(HALF, float32)
        ds = cuda.local.array(HALF, float32)
        for i in range(tid, R * d, NT):
            r = i // d
            qi = r // rep
            qs[i] = qp[row0 + qi, h * rep + (r - qi * rep), i - r * d] if qi < nrows else float32(0.0)
        for i in range(tid, cnt * R, NT):
            lg[i] = float32(0.0)
        # ---- key pass: logits, group-major ------------------------------------------------
        for j in range(Gk):
            cuda.syncthreads()
            if stage_k:
                for i in range(tid, Kk * gk, NT):
                    cbk[i] = k_cb[h, j, i // gk, i % gk]
            cuda.syncthreads()
            if tid < cnt:
                for l in range(HALF):
                    f = freq[h, j, l]
                    c0, s0 = precise_sincos(float32(t0 + tid), f)
                    c1, s1 = precise_sincos(fNT, f)
                    cc[l] = c0
                    ss[l] = s0
                    dc[l] = c1
                    ds[l] = s1
            for t in range(t0 + tid, t1, NT):
                slot = kv_indices[start + t]
                if t < sink or t >= win_hi or (has_kept and kept[slot] != 0):
                    for l in range(gk):
                        x[l] = ldf(k_full[slot, h, perm[h, j * gk + l]])
                else:
                    code = unpack(k_codes, slot, h * Gk + j, kbits)
                    sc = float32(1.0)
                    if use_scale:
                        sc = float32(k_scale[slot, h]) if per_head else float32(k_scale[slot])
                    for l in range(gk):
                        cw = cbk[code * gk + l] if stage_k else k_cb[h, j, code, l]
                        x[l] = float32(cw) * sc
                for l in range(HALF):
                    a = x[l]
                    b = x[l + HALF]
                    x[l] = a * cc[l] - b * ss[l]
                    x[l + HALF] = b * cc[l] + a * ss[l]
                    c2 = cc[l] * dc[l] - ss[l] * ds[l]
                    ss[l] = ss[l] * dc[l] + cc[l] * ds[l]
                    cc[l] = c2
                base = (t - t0) * R
                for r in range(R):
                    dot = float32(0.0)
                    for l in range(gk):
                        dot += qs[r * d + j * gk + l] * x[l]
                    lg[base + r] += dot
        cuda.syncthreads()
        # ---- softmax statistics over the split ------------------------------------------
        for r in range(R):
            m = ninf
            for tt in range(tid, cnt, NT):
                v = lg[tt * R + r] * logit_scale
                lg[tt * R + r] = v
                m = max(m, v)
            red[r * NT + tid] = m
        cuda.syncthreads()
        step = NT // 2
        while step > 0:
            if tid < step:
                for r in range(R):
                    red[r * NT + tid] = max(red[r * NT + tid], red[r * NT + tid + step])
            cuda.syncthreads()
            step //= 2
        if tid < R:
            stat[tid] = red[tid * NT]
        cuda.syncthreads()
        for r in range(R):
            m = stat[r]
            acc = float32(0.0)
            for tt in range(tid, cnt, NT):
                p = exp32(lg[tt * R + r] - m)
                lg[tt * R + r] = p
                acc += p
            red[r * NT + tid] = acc
        cuda.syncthreads()
        step = NT // 2
        while step > 0:
            if tid < step:
                for r in range(R):
                    red[r * NT + tid] += red[r * NT + tid + step]
            cuda.syncthreads()
            step //= 2
        if tid < R:
            qi = tid // rep
            if qi < nrows:
                hq = h * rep + tid - qi * rep
                part_ml[row0 + qi, hq, s, 0] = stat[tid]
                part_ml[row0 + qi, hq, s, 1] = red[tid * NT]
        # ---- value pass, group-major ------------------------------------------------------
        acc = cuda.local.array(O, float32)
        vv = cuda.local.array(gv, float32)
        for j in range(Gv):
            cuda.syncthreads()
            if stage_v:
                for i in range(tid, Kv * gv, NT):
                    cbv[i] = v_cb[h, j, i // gv, i % gv]
            cuda.syncthreads()
            for o in range(O):
                acc[o] = float32(0.0)
            for t in range(t0 + tid, t1, NT):
                slot = kv_indices[start + t]
                if t < sink or t >= win_hi or (has_kept and kept[slot] != 0):
                    for c in range(gv):
                        vv[c] = ldf(v_full[slot, h, j * gv + c])
                else:
                    code = unpack(v_codes, slot, h * Gv + j, vbits)
                    for c in range(gv):
                        vv[c] = float32(cbv[code * gv + c] if stage_v else v_cb[h, j, code, c])
                base = (t - t0) * R
                for r in range(R):
                    p = lg[base + r]
                    for c in range(gv):
                        acc[r * gv + c] += p * vv[c]
            for o in range(O):
                red[tid * (O + 1) + o] = acc[o]
            cuda.syncthreads()
            for o2 in range(tid, O * P, NT):  # stage 1: P partial sums per output, all threads busy
                o = o2 % O
                tot = float32(0.0)
                for i in range(o2 // O, NT, P):
                    tot += red[i * (O + 1) + o]
                red2[o2] = tot
            cuda.syncthreads()
            for o in range(tid, O, NT):
                tot = float32(0.0)
                for part in range(P):
                    tot += red2[part * O + o]
                r = o // gv
                qi = r // rep
                if qi < nrows:
                    part_acc[row0 + qi, h * rep + r - qi * rep, s, j * gv + o - r * gv] = tot

    sc = {"shared": "float16[::1]", "per_head": "float16[:, ::1]", "none": "float16[::1]"}[scale_mode]
    fk = KINDS[full_kind]
    sig = (f"void(float32[:, :, ::1], uint8[:, ::1], uint8[:, ::1], {sc}, {fk}[:, :, ::1], {fk}[:, :, ::1], "
           f"int32[::1], int32[::1], int32[:, ::1], float16[:, :, :, ::1], float16[:, :, :, ::1], "
           f"float32[:, :, ::1], int32[:, ::1], uint8[::1], int32, int32, int32, float32, "
           f"float32[:, :, :, ::1], float32[:, :, :, ::1])")
    name = (f"cache_attn_d{d}_rep{rep}_qt{QT}{'t' if tiled else ''}_K{Kk}x{gk}_V{Kv}x{gv}_{scale_mode}_{full_kind}"
            f"{'_kept' if has_kept else ''}")
    return KernelSpec(name, kern, sig)


@functools.lru_cache(maxsize=None)
def reduce_kernel(d: int, has_chunk: bool, per_row: bool) -> KernelSpec:
    """Grid (NQ, Hq), block d: merge split partials into out [NQ, Hq, d] f32.

    part_acc [NQ, Hq, NS, d], part_ml [NQ, Hq, NS, 2], kv_indptr i32 [B+1], row_req i32 [NQ]
    (request of each row when per_row, else row = request), split_len. Prefix splits are
    0 .. ceil(n / split_len) - 1; with has_chunk the chunk partial sits at NS - 1.
    """

    def kern(part_acc, part_ml, kv_indptr, row_req, split_len, out):
        row = cuda.blockIdx.x
        hq = cuda.blockIdx.y
        c = cuda.threadIdx.x
        NS = part_ml.shape[2]
        req = row_req[row] if per_row else row
        n = kv_indptr[req + 1] - kv_indptr[req]
        ns = (n + split_len - 1) // split_len
        m = float32(-math.inf)
        for s in range(ns):
            m = max(m, part_ml[row, hq, s, 0])
        if has_chunk:
            m = max(m, part_ml[row, hq, NS - 1, 0])
        den = float32(0.0)
        num = float32(0.0)
        for s in range(ns):
            w = exp32(part_ml[row, hq, s, 0] - m)
            den += w * part_ml[row, hq, s, 1]
            num += w * part_acc[row, hq, s, c]
        if has_chunk:
            w = exp32(part_ml[row, hq, NS - 1, 0] - m)
            den += w * part_ml[row, hq, NS - 1, 1]
            num += w * part_acc[row, hq, NS - 1, c]
        out[row, hq, c] = num / den if den > float32(0.0) else float32(0.0)

    sig = ("void(float32[:, :, :, ::1], float32[:, :, :, ::1], int32[::1], int32[::1], int32, "
           "float32[:, :, ::1])")
    return KernelSpec(f"reduce_d{d}_{'chunk' if has_chunk else 'plain'}", kern, sig)
