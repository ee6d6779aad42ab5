"""Kernel-vs-reference cases for the CUDA simulator, run in a fresh process.

``python -m numba_kernels.sim_cases GROUP`` sets ``NUMBA_ENABLE_CUDASIM=1`` before numba is
imported (so it cannot clash with other tests importing numba for real), runs every case of
GROUP (encode, decode, extend, rope) and prints one JSON line per case; the exit status is
non-zero when a case fails. tests/test_kernels_sim.py drives it. Shapes are tiny on purpose:
the simulator runs one block at a time as Python threads.
"""
from __future__ import annotations

from sglang_tasq.options import set_env

set_env("NUMBA_ENABLE_CUDASIM", "1")

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

from sglang_tasq import codec, packing  # noqa: E402
from sglang_tasq.config import TaSQConfig  # noqa: E402
from sglang_tasq.testing import random_codebooks  # noqa: E402

from . import ops, reference as ref  # noqa: E402
from .devfns import precise_sincos  # noqa: E402
from .tables import LayerTables  # noqa: E402

DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _tables(H, d, K=64, g=8, scale="shared", seed=0, **kw):
    cfg = TaSQConfig(group_size_k=g, group_size_v=g, codebook_size_k=K, codebook_size_v=K, scale=scale, **kw)
    return LayerTables.from_codebooks(random_codebooks(1, H, d, cfg, seed=seed), 0)


def case_encode(H, d, K, g, scale, T, kind, loc_dtype, seed=0, **kw):
    tb = _tables(H, d, K, g, scale, seed, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    k = (torch.randn(T, H, d, generator=gen) * 3).to(DT[kind])
    v = torch.randn(T, H, d, generator=gen)
    v[0] = tb.v_cb[:, :, K - 1].float().reshape(H, d)  # token 0 codes to K - 1 everywhere
    v = v.to(DT[kind])
    S = T + 5
    loc = torch.randperm(S, generator=gen)[:T].to(loc_dtype)
    got, want = tb.allocate_pool(S), tb.allocate_pool(S)
    ops.encode_kv(k, v, loc, tb, got["k_codes"], got["v_codes"], got["k_scale"])
    ref.encode_kv_ref(k, v, loc, tb, want["k_codes"], want["v_codes"], want["k_scale"])
    cfg, cb = tb.config, tb.codebooks()
    li = loc.long()
    if scale != "none":
        ds = (got["k_scale"][li].float() - want["k_scale"][li].float()).abs()
        assert (ds <= 1e-3 * want["k_scale"][li].float()).all(), f"scale mismatch {ds.max()}"
    vc = packing.unpack_codes(got["v_codes"][li], H * (d // g), cfg.code_bits_v)
    assert (vc[0] == K - 1).all(), "max code K-1 not reproduced"
    for name, bits, x, tcb in (("k", cfg.code_bits_k, codec.key_tailor(k, cb, 0)[0], cb.tailored_k_codebook(0)),
                               ("v", cfg.code_bits_v, v.float().view(T, H, d // g, g), cb.v_codebook[0])):
        a = packing.unpack_codes(got[f"{name}_codes"][li], H * (d // g), bits).view(T, H, -1)
        b = packing.unpack_codes(want[f"{name}_codes"][li], H * (d // g), bits).view(T, H, -1)
        diff = a != b
        if diff.any():  # near-ties only: both codewords at (numerically) equal distance
            hh = torch.arange(H).view(1, H, 1).expand_as(a)
            gg = torch.arange(d // g).view(1, 1, -1).expand_as(a)
            da = (x - tcb[hh, gg, a]).pow(2).sum(-1)
            db = (x - tcb[hh, gg, b]).pow(2).sum(-1)
            gap = (da - db).abs()[diff]
            assert (gap <= 1e-4 * (1 + db[diff])).all(), f"{name} codes differ by {gap.max()} ({int(diff.sum())})"
    return {"near_ties": int(sum((got[n] != want[n]).sum() for n in ("k_codes", "v_codes")))}


def _cache(tb, lens, seed, full_kind):
    """Random pool with packed random codes (max value included), scales and full copies."""
    gen = torch.Generator().manual_seed(seed)
    H, d, cfg = tb.num_kv_heads, tb.head_dim, tb.config
    total = sum(lens)
    S = total + 4
    slots = torch.randperm(S, generator=gen)[:total].to(torch.int32)
    kv_indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    pool = tb.allocate_pool(S)
    for name, G, K, bits in (("k", tb.k_groups, tb.k_cb.shape[2], cfg.code_bits_k),
                             ("v", tb.v_groups, tb.v_cb.shape[2], cfg.code_bits_v)):
        codes = torch.randint(0, K, (S, H * G), generator=gen)
        codes[:: 3] = K - 1
        pool[f"{name}_codes"].copy_(packing.pack_codes(codes, bits))
    if cfg.scale != "none":
        pool["k_scale"].copy_((torch.rand(pool["k_scale"].shape, generator=gen) + 0.5).half())
    kf = torch.randn(S, H, d, generator=gen).to(DT[full_kind])
    vf = torch.randn(S, H, d, generator=gen).to(DT[full_kind])
    return pool, slots, kv_indptr, kf, vf


def _close(got, want, what):
    err = (got - want).abs().max().item() if got.numel() else 0.0
    tol = 2e-4 + 1e-3 * want.abs().max().item() if want.numel() else 0.0
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"
    return err


def case_decode(rep, H, d, lens, K=64, g=8, scale="shared", split_len=None, sink=0, recent=0,
                full_kind="f16", q_kind="f32", seed=0, noncontig=False, kept=False):
    """``kept``: a random third of the slots are salient tokens read from k_full/v_full."""
    tb = _tables(H, d, K, g, scale, seed)
    pool, slots, kv_indptr, kf, vf = _cache(tb, lens, seed + 7, full_kind)
    B, Hq = len(lens), rep * H
    q = torch.randn(B, Hq, 2 * d if noncontig else d, generator=torch.Generator().manual_seed(seed))
    q = (q[:, :, d:] if noncontig else q).to(DT[q_kind])
    win = (kf, vf, sink, recent) if sink + recent or kept else (None, None, 0, 0)
    args = (q, pool["k_codes"], pool["v_codes"], pool["k_scale"], kv_indptr, slots, tb, 1.0 / math.sqrt(d)) + win
    flags = None
    if kept:
        flags = (torch.rand(kf.shape[0], generator=torch.Generator().manual_seed(seed + 3)) < 1 / 3).to(torch.uint8)
    out = torch.full((B, Hq, d), float("nan"))
    got = ops.decode_attention(*args, out=out, split_len=split_len, kept=flags)
    want = ref.decode_attention_ref(*args, kept=flags)
    res = {"err": _close(got, want, "decode")}
    if kept:  # the flags matter: without them the same call reads those slots from their codes
        plain = ref.decode_attention_ref(*args)
        res["kept_moves"] = float((plain - want).abs().max())
        assert res["kept_moves"] > 1e-2, res
    return res


def case_extend(rep, H, d, prefix, chunk, K=64, g=8, scale="shared", split_len=None, sink=0, recent=0,
                full_kind="f16", kind="f32", seed=0):
    tb = _tables(H, d, K, g, scale, seed)
    pool, slots, kv_indptr, kf, vf = _cache(tb, prefix, seed + 3, full_kind)
    gen = torch.Generator().manual_seed(seed)
    N, Hq = sum(chunk), rep * H
    qo = torch.tensor([0] + chunk).cumsum(0).to(torch.int32)
    q = torch.randn(N, Hq, d, generator=gen).to(DT[kind])
    kc = torch.randn(N, H, d, generator=gen).to(DT[kind])
    vc = torch.randn(N, H, d, generator=gen).to(DT[kind])
    win = (kf, vf, sink, recent) if sink + recent else (None, None, 0, 0)
    args = (q, kc, vc, qo, pool["k_codes"], pool["v_codes"], pool["k_scale"], kv_indptr, slots, tb, 0.3) + win
    got = ops.extend_attention(*args, split_len=split_len)
    want = ref.extend_attention_ref(*args)
    return {"err": _close(got, want, "extend")}


def case_rope():
    """precise_sincos against float64 at positions up to 131072 and Llama/SmolLM2 frequencies."""
    worst = 0.0
    for d, theta in ((128, 500000.0), (64, 100000.0)):
        inv = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float()
        for p in (0, 1, 4095, 60000, 60001, 105000, 131071):
            for f in inv.tolist():
                c, s = precise_sincos(torch.tensor(float(p)).float().numpy(), torch.tensor(f).float().numpy())
                a = p * float(torch.tensor(f).float())
                worst = max(worst, abs(float(c) - math.cos(a)), abs(float(s) - math.sin(a)))
    assert worst < 2e-6, f"sincos error {worst}"
    return {"err": worst}


GROUPS = {
    "encode": [
        ("enc_shared_f32_T1", lambda: case_encode(3, 16, 64, 8, "shared", 1, "f32", torch.int64)),
        ("enc_shared_bf16_T97_int32", lambda: case_encode(2, 16, 16, 8, "shared", 97, "bf16", torch.int32)),
        ("enc_perhead_f16_10bit", lambda: case_encode(2, 16, 1024, 4, "per_head", 3, "f16", torch.int64)),
        ("enc_none_12bit", lambda: case_encode(1, 16, 4096, 8, "none", 2, "f32", torch.int64)),
        ("enc_8bit_g2", lambda: case_encode(1, 8, 256, 2, "shared", 5, "f16", torch.int32)),
    ],
    "decode": [
        ("dec_rep1_ragged_splits", lambda: case_decode(1, 2, 16, [1, 97, 0, 5], split_len=16)),
        ("dec_rep3_window_bf16", lambda: case_decode(3, 3, 16, [1, 20, 7], sink=2, recent=3, full_kind="bf16",
                                                     q_kind="bf16", split_len=8)),
        ("dec_rep4_perhead_8bit", lambda: case_decode(4, 2, 16, [9, 33], K=256, scale="per_head", sink=1, recent=4,
                                                      full_kind="f32", q_kind="f16", noncontig=True)),
        ("dec_rep8_none_12bit_10bit", lambda: case_decode(8, 1, 32, [12, 3], K=4096, scale="none", split_len=5)),
        ("dec_rep1_10bit_g4_window_all", lambda: case_decode(1, 1, 16, [6, 2], K=1024, g=4, sink=3, recent=3)),
        ("dec_long_4099", lambda: case_decode(1, 1, 16, [4099, 2], K=16)),
        ("dec_rep3_kept_window_bf16", lambda: case_decode(3, 3, 16, [1, 40, 13], sink=2, recent=3, full_kind="bf16",
                                                          q_kind="bf16", split_len=8, kept=True)),
        ("dec_rep2_kept_nowin_perhead", lambda: case_decode(2, 2, 16, [30, 9], scale="per_head", kept=True, seed=4)),
    ],
    "extend": [
        ("ext_rep3_window", lambda: case_extend(3, 3, 16, [0, 5, 19], [3, 1, 4], sink=1, recent=2, split_len=8)),
        ("ext_rep4_bf16_perhead", lambda: case_extend(4, 2, 16, [33, 0], [2, 5], scale="per_head", kind="bf16",
                                                      full_kind="bf16", sink=2, recent=2)),
        ("ext_rep1_f16_nowin", lambda: case_extend(1, 2, 16, [10], [9], K=1024, g=4, kind="f16", split_len=4)),
        ("ext_rep8_none", lambda: case_extend(8, 1, 16, [3, 7], [1, 2], scale="none")),
    ],
    "rope": [("rope_precise_sincos", case_rope)],
}


def main(argv):
    groups = argv or list(GROUPS)
    failed = 0
    for grp in groups:
        for name, fn in GROUPS[grp]:
            t = time.time()
            try:
                res = {"case": name, "ok": True, **fn()}
            except Exception as e:  # report and continue with the next case
                failed += 1
                res = {"case": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                       "trace": traceback.format_exc(limit=3)}
            res["secs"] = round(time.time() - t, 2)
            print(json.dumps(res), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
