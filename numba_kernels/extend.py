"""Causal attention of extend (prefill) rows over their own chunk's full-precision keys.

The compressed prefix of an extend batch goes through :func:`.attention.cache_kernel`
(query tiles of one request); this kernel adds the chunk part: row i of request b attends
to chunk keys ``qo_indptr[b] .. i`` (post-RoPE, as SGLang hands them over), with an online
softmax in fp32, and stores its partial (max, sum, unnormalised output) at the LAST split
index of the partial buffers, where :func:`.attention.reduce_kernel` (has_chunk=True)
merges it with the prefix splits. Plain and quadratic in the chunk length: prefill is
dominated by the model's own matmuls and the encode, not by this kernel.
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32

from .devfns import KINDS, exp32, loader
from .encode import KernelSpec


@functools.lru_cache(maxsize=None)
def chunk_kernel(d: int, rep: int, kind: str) -> KernelSpec:
    """Grid (N, H), block d.

    q f32 [N, Hq, d] (native order, post-RoPE), k_chunk/v_chunk [N, H, d] (kind), row_req
    i32 [N], qo_indptr i32 [B+1], logit_scale -> part_acc [N, Hq, NS, d], part_ml [N, Hq, NS, 2]
    at split NS - 1.
    """
    NT = d
    QS = rep * d
    LG = NT * rep
    ld = loader(kind)
    ninf = float32(-math.inf)

    def kern(q, k_chunk, v_chunk, row_req, qo_indptr, logit_scale, part_acc, part_ml):
        i = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        NS = part_ml.shape[2]
        q0 = qo_indptr[row_req[i]]
        qs = cuda.shared.array(QS, float32)
        lg = cuda.shared.array(LG, float32)
        m = cuda.local.array(rep, float32)
        den = cuda.local.array(rep, float32)
        acc = cuda.local.array(rep, float32)
        for r in range(rep):
            qs[r * d + tid] = q[i, h * rep + r, tid]
            m[r] = ninf
            den[r] = float32(0.0)
            acc[r] = float32(0.0)
        for k0 in range(q0, i + 1, NT):
            cuda.syncthreads()
            k = k0 + tid
            if k <= i:
                for r in range(rep):
                    dot = float32(0.0)
                    for c in range(d):
                        dot += qs[r * d + c] * ld(k_chunk[k, h, c])
                    lg[tid * rep + r] = dot * logit_scale
            cuda.syncthreads()
            nvalid = min(NT, i + 1 - k0)
            for r in range(rep):
                tm = ninf
                for kk in range(nvalid):
                    tm = max(tm, lg[kk * rep + r])
                mnew = max(m[r], tm)
                corr = exp32(m[r] - mnew)
                den[r] *= corr
                acc[r] *= corr
                for kk in range(nvalid):
                    p = exp32(lg[kk * rep + r] - mnew)
                    den[r] += p
                    acc[r] += p * ld(v_chunk[k0 + kk, h, tid])
                m[r] = mnew
        for r in range(rep):
            part_acc[i, h * rep + r, NS - 1, tid] = acc[r]
            if tid == 0:
                part_ml[i, h * rep + r, NS - 1, 0] = m[r]
                part_ml[i, h * rep + r, NS - 1, 1] = den[r]

    fk = KINDS[kind]
    sig = (f"void(float32[:, :, ::1], {fk}[:, :, ::1], {fk}[:, :, ::1], int32[::1], int32[::1], float32, "
           f"float32[:, :, :, ::1], float32[:, :, :, ::1])")
    return KernelSpec(f"chunk_attn_d{d}_rep{rep}_{kind}", kern, sig, hot=False)
