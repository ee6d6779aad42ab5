"""Numba CPU decode attention (numba_kernels.cpu: DecodeTables, DecodePlan, split-K
decode_attention with exact window entries and kept slots) against the plain-torch reference
codec, on ragged batches, radix-shared prefixes, stale and absent window entries, and kept
(salient) slots in and out of the window, with and without entries."""
import dataclasses

import numpy as np
import pytest
import torch

from numba_kernels import cpu
from sglang_tasq import codec, packing
from sglang_tasq.config import TaSQConfig
from sglang_tasq.rope import cos_sin
from sglang_tasq.testing import random_codebooks
from sglang_tasq.windows import in_window



def _pool_case(cfg, H, Hq, d, seq_lens, seed, windows):
    """Random packed pool rows for requests of the given lengths, their slots, and an exact store.

    Request 1 starts on request 0's first 3 slots (a radix-shared prefix: its codes and entries
    are the slots'). With windows, ``win = (entry_of [rows], win_k, win_v [E + 1, H, d] bf16)``:
    a slot holds an entry where some request holding it has the position inside its window or
    up to 2 positions before it (stale entries: read from codes), except every 7th such slot
    (absent: codes even inside the window) and the slots of every third request (none at all)."""
    cb = random_codebooks(1, H, d, cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    rows = total + 7
    slots = torch.randperm(rows - 1, generator=gen)[:total] + 1  # slot 0 unused, scattered slots
    starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()
    if len(seq_lens) > 1 and min(seq_lens[:2]) >= 3:
        slots[starts[1]:starts[1] + 3] = slots[:3]
    k_pre = torch.randn(total, H, d, generator=gen)
    v = torch.randn(total, H, d, generator=gen)
    x, scale = codec.key_tailor(k_pre, cb, 0)
    kc = codec.nearest_codeword(x, cb.tailored_k_codebook(0))
    vc = codec.encode_values(v, cb, 0)
    Gk, Gv = d // cfg.group_size_k, d // cfg.group_size_v
    kb = packing.packed_row_bytes(H * Gk, cfg.code_bits_k)
    krow = packing.pack_codes(kc.reshape(total, -1), cfg.code_bits_k)
    if scale is not None:
        krow = torch.cat([krow, scale.reshape(total, -1).contiguous().view(torch.uint8)], 1)
    k_rows = torch.zeros(rows, krow.shape[1], dtype=torch.uint8)
    v_rows = torch.zeros(rows, packing.packed_row_bytes(H * Gv, cfg.code_bits_v), dtype=torch.uint8)
    k_rows[slots] = krow  # a shared slot holds the codes of its last writer
    v_rows[slots] = packing.pack_codes(vc.reshape(total, -1), cfg.code_bits_v)
    B = len(seq_lens)
    win = None
    if windows:
        sink, recent = cfg.sink_window, cfg.recent_window
        keep = []
        for b, S in enumerate(seq_lens):
            if b % 3 == 2:
                continue
            for p in range(S):
                s = int(slots[starts[b] + p])
                if (p < sink or (recent and p >= S - recent - 2)) and s % 7 and s not in keep:
                    keep.append(s)
        E = len(keep) + 3  # spare entries: the store is not full
        entry_of = torch.zeros(rows, dtype=torch.int64)
        entry_of[torch.tensor(keep, dtype=torch.int64)] = torch.randperm(E, generator=gen)[:len(keep)] + 1
        wk = torch.randn(E + 1, H, d, generator=gen).to(torch.bfloat16)
        wv = torch.randn(E + 1, H, d, generator=gen).to(torch.bfloat16)
        win = (entry_of, wk, wv)
    q = torch.randn(B, Hq, d, generator=gen)
    return cb, kb, k_rows, v_rows, slots, q, win


def _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, H, d, sm_scale, kept=None):
    """Plain-torch codec per request; position t of a request of length S reads its slot's
    entry iff (t < sink or t >= S - recent, or the slot is kept: ``kept[slot] != 0``, kept
    [rows] uint8 or bool, None: none) and the slot holds one."""
    Gk, Gv = d // cfg.group_size_k, d // cfg.group_size_v
    outs, beg = [], 0
    for b, S in enumerate(seq_lens):
        sl = slots[beg:beg + S]
        beg += S
        if S == 0:
            outs.append(torch.zeros(q.shape[1], d))
            continue
        kr = k_rows[sl]
        kc = packing.unpack_codes(kr[:, :kb].contiguous(), H * Gk, cfg.code_bits_k).view(S, H, Gk)
        scale = None
        if cfg.scale != "none":
            scale = torch.empty(S, kr.shape[1] - kb, dtype=torch.uint8).copy_(kr[:, kb:]).view(torch.float16)
            scale = scale.reshape(S, -1)  # [S, scales per token]: apply_scale spreads a group's over its heads
        vc = packing.unpack_codes(v_rows[sl], H * Gv, cfg.code_bits_v).view(S, H, Gv)
        pos = torch.arange(S)
        kw = vw = mask = None
        if win is not None:
            entry_of, wk, wv = win
            ent = entry_of[sl]
            exact = in_window(pos, S, cfg.sink_window, cfg.recent_window)
            if kept is not None:
                exact = exact | (kept[sl] != 0)
            mask = exact & (ent > 0)
            kw, vw = wk[ent], wv[ent]
        o = codec.attention_over_codes(q[b:b + 1], torch.tensor([S - 1]), kc, scale, vc, pos, cb, 0, sm_scale,
                                       k_full=kw, v_full=vw, full_mask=mask)
        outs.append(o[0])
    return torch.stack(outs)


@pytest.mark.parametrize("split_tokens", [None, 1, 3, 7, 40])  # None: cpu.SPLIT_TOKENS
@pytest.mark.parametrize("scale,windows,H,Hq,d,seq_lens", [
    ("shared", (4, 8), 3, 9, 16, [1, 5, 97, 0, 40]),
    ("per_head", None, 2, 2, 8, [3, 64]),
    ("none", (4, 8), 1, 4, 32, [70, 2, 33]),
    ("shared", (4, 8), 1, 3, 16, [300]),  # one request: split-K is what fills the threads
    ("per_head", (0, 5), 2, 4, 16, [20, 9, 12]),  # recent only
    ("shared", (3, 0), 2, 4, 16, [20, 2, 7]),  # sink only
    ("shared/2", (4, 8), 4, 8, 16, [5, 40, 33]),  # 2 scale groups of 2 heads (a TP-2 artifact at TP 1)
    ("shared/3", None, 3, 6, 8, [17, 3]),  # 3 groups of 1 head
    ("shared", (4, 8), 1, 2, 16, [4100, 600]),  # RoPE rows composed far from position 0
])
def test_decode_attention_matches_reference(scale, windows, H, Hq, d, seq_lens, split_tokens):
    """Split-K (splits past a short request's end are empty) merges to the unsplit answer;
    window tokens come from their slots' entries, everything else (stale or absent entries
    included) from codes."""
    sink, recent = windows or (0, 0)
    scale, _, groups = scale.partition("/")
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, scale=scale,
                     scale_groups=int(groups or 1), sink_window=sink, recent_window=recent)
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, H, Hq, d, seq_lens, 11, windows is not None)
    sm_scale = d ** -0.5
    ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, H, d, sm_scale)
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    cos, sin = cos_sin(torch.arange(max(seq_lens) + 3), cb.inv_freq, cb.attention_scaling)
    entry_of, wk, wv = win if win is not None else (None, None, None)
    got = cpu.decode_attention(q, k_rows, v_rows, indptr, slots, cpu.DecodeTables(cb, 0), cfg, kb, cos, sin,
                               sm_scale, entry_of, wk, wv, split_tokens=split_tokens)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    if win is not None and split_tokens is None:
        # the windows matter: codes alone give another answer, and so do [E + 1, 1, H, d] views
        # of the same entries (the pool's layout) give the same one
        alone = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, None, H, d, sm_scale)
        assert float((alone - ref).abs().max()) > 1e-3
        got4 = cpu.decode_attention(q, k_rows, v_rows, indptr, slots, cpu.DecodeTables(cb, 0), cfg, kb, cos, sin,
                                    sm_scale, entry_of, wk.unsqueeze(1), wv.unsqueeze(1))
        assert torch.equal(got4, got)


def test_rope_composes_only_for_a_rotation_table():
    """The decode kernel rotates position t0 + i by R_t0 R_i / m only where the table is one:
    cos_sin's tables (attention scaling m included) are, a position-dependent scaling, a
    non-zero angle at position 0 or a corrupted row are not."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    for m in (1.0, 1.3):
        c, s = (x.numpy() for x in cos_sin(torch.arange(5000), inv_freq, m))
        assert cpu.rope_composes(c, s, 256, 5000) and cpu.rope_composes(c, s, 7, 300)
    damp = (1.0 + 1e-3 * np.arange(5000))[:, None].astype(np.float32)
    assert not cpu.rope_composes(c * damp, s * damp, 256, 5000)
    c2, s2 = (x.numpy() for x in cos_sin(torch.arange(5000) + 3, inv_freq))
    assert not cpu.rope_composes(c2, s2, 256, 5000)
    bad = c.copy()
    bad[256 + 128, 2] += 0.05  # a split start plus chunk / 2: a probed row
    assert not cpu.rope_composes(bad, s, 256, 5000)


def test_decode_attention_per_token_rope_gather_matches_reference():
    """The path for a table that does not compose (each key's rotation gathered from its own
    row) gives the reference answer too, and the composed path's within float rounding."""
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, sink_window=4,
                     recent_window=8)
    seq_lens = [700, 5, 300]
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, 2, 6, 16, seq_lens, 5, True)
    entry_of, wk, wv = win
    cos, sin = cos_sin(torch.arange(710), cb.inv_freq, cb.attention_scaling)
    ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, 2, 16, 0.25)
    outs = []
    for composed in (True, False):
        plan = cpu.DecodePlan(torch.tensor([0] + seq_lens).cumsum(0), slots, cfg, kb, 6, 2, 16, cos, sin, entry_of)
        assert plan.composed
        plan.composed = composed
        outs.append(plan(q, k_rows, v_rows, cpu.DecodeTables(cb, 0), 0.25, wk.unsqueeze(1), wv.unsqueeze(1)))
        torch.testing.assert_close(outs[-1], ref, rtol=2e-5, atol=2e-5)
    assert not torch.equal(outs[0], outs[1])  # two paths, not one taken twice


def test_decode_tables_share_the_encoder_arrays_and_fall_back_on_zero_weights():
    """The tables are views of the encoder's codeword rows (one copy of each codebook); a zero
    weight (never from calibration) takes the raw key codebook, and both decode alike."""
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8,
                     sink_window=4, recent_window=8)
    seq_lens = [50, 7]
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, 2, 4, 16, seq_lens, 3, True)
    enc = cpu.PoolEncoder(cb)
    tab = cpu.DecodeTables(cb, 0, enc.prepared(0))
    assert np.shares_memory(tab.kcb, enc.prepared(0)[0][2]) and np.shares_memory(tab.vcb, enc.prepared(0)[1][2])
    cos, sin = cos_sin(torch.arange(60), cb.inv_freq, cb.attention_scaling)
    entry_of, wk, wv = win
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, 2, 16, 0.25)
    got = cpu.decode_attention(q, k_rows, v_rows, indptr, slots, tab, cfg, kb, cos, sin, 0.25, entry_of, wk, wv)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    cb.k_weight[0, 1, 3] = 0.0
    raw = cpu.DecodeTables(cb, 0)
    assert np.all(raw.kw == 1) and np.array_equal(raw.kcb, cb.k_codebook[0].numpy())
    ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, 2, 16, 0.25)
    got = cpu.decode_attention(q, k_rows, v_rows, indptr, slots, raw, cfg, kb, cos, sin, 0.25, entry_of, wk, wv)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_decode_plan_reads_entries_through_a_view():
    """A plan is built once per forward, before the step's window entries are assigned: it
    reads ``entry_of`` (and the entries) through views, so later assignments are seen; a
    non-int64 or non-contiguous ``entry_of`` is refused."""
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8,
                     sink_window=2, recent_window=4)
    seq_lens = [30, 9]
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, 2, 4, 16, seq_lens, 8, True)
    entry_of, wk, wv = win
    cos, sin = cos_sin(torch.arange(40), cb.inv_freq, cb.attention_scaling)
    tab = cpu.DecodeTables(cb, 0)
    live = torch.zeros_like(entry_of)
    wk4, wv4 = torch.zeros_like(wk).unsqueeze(1), torch.zeros_like(wv).unsqueeze(1)
    plan = cpu.DecodePlan(torch.tensor([0] + seq_lens).cumsum(0), slots, cfg, kb, 4, 2, 16, cos, sin, live)
    none = plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4)
    torch.testing.assert_close(none, _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, None, 2, 16, 0.25),
                               rtol=2e-5, atol=2e-5)
    live.copy_(entry_of)
    wk4.copy_(wk.unsqueeze(1))
    wv4.copy_(wv.unsqueeze(1))
    got = plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4)
    torch.testing.assert_close(got, _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, 2, 16, 0.25),
                               rtol=2e-5, atol=2e-5)
    from numba_kernels.fastpath import u16_view

    assert torch.equal(plan(q, k_rows.numpy(), v_rows.numpy(), tab, 0.25, u16_view(wk4), u16_view(wv4)), got)
    for bad in (entry_of.to(torch.int32), torch.stack([entry_of, entry_of], 1)[:, 0]):
        with pytest.raises(TypeError, match="entry_of"):
            cpu.DecodePlan(torch.tensor([0] + seq_lens).cumsum(0), slots, cfg, kb, 4, 2, 16, cos, sin, bad)
    with pytest.raises(TypeError, match="bfloat16"):
        plan(q, k_rows, v_rows, tab, 0.25, wk4.float(), wv4.float())


def test_decode_attention_is_batch_invariant():
    """A request's output is bit-identical alone and inside batches of other lengths (split-K
    ranges are fixed positions, not chosen from the batch)."""
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8,
                     sink_window=4, recent_window=8)
    seq_lens = [700, 90, 1, 300]
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, 3, 9, 16, seq_lens, 5, True)
    entry_of, wk, wv = win
    cos, sin = cos_sin(torch.arange(800), cb.inv_freq, cb.attention_scaling)
    tab = cpu.DecodeTables(cb, 0)
    starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()

    def run(sel):
        lens = [seq_lens[i] for i in sel]
        idx = torch.cat([slots[starts[i]:starts[i + 1]] for i in sel])
        return cpu.decode_attention(q[sel], k_rows, v_rows, torch.tensor([0] + lens).cumsum(0), idx, tab, cfg, kb,
                                    cos, sin, 0.25, entry_of, wk, wv, split_tokens=128)

    full = run([0, 1, 2, 3])
    for i in range(4):
        assert torch.equal(run([i])[0], full[i])
    assert torch.equal(run([3, 0])[1], full[0])


def test_decode_attention_refuses_dense_weighting():
    cb = random_codebooks(1, 2, 16, TaSQConfig(codebook_size_k=64, codebook_size_v=64))
    cb = dataclasses.replace(cb, k_unmix=torch.eye(16).expand(1, 2, 16, 16))
    with pytest.raises(NotImplementedError, match="dense"):
        cpu.DecodeTables(cb, 0)


def _kept_case(win, slots, seq_lens, cfg, seed):
    """Kept (salient) slots for a :func:`_pool_case` with windows -> (kept [rows] uint8, the
    window store with entries added, the kept slots read exactly outside a window).

    About a third of the used slots are kept (in and out of the window, shared prefix
    included); a kept slot without an entry gets one, except where ``slot % 5 == 0`` (kept but
    absent: codes). The unused slot 0 and last row are kept too (never read). Flags are bytes
    other than 1 as well (any non-zero is kept)."""
    entry_of, wk, wv = win
    entry_of = entry_of.clone()
    gen = torch.Generator().manual_seed(seed)
    rows = entry_of.shape[0]
    kept = torch.zeros(rows, dtype=torch.uint8)
    used = torch.unique(slots)
    pick = used[torch.rand(used.numel(), generator=gen) < 0.35]
    kept[pick] = torch.randint(1, 256, (pick.numel(),), generator=gen, dtype=torch.int64).to(torch.uint8)
    kept[0] = kept[rows - 1] = 1
    new = [int(x) for x in pick if entry_of[x] == 0 and int(x) % 5]
    E = wk.shape[0] - 1
    entry_of[torch.tensor(new, dtype=torch.int64)] = torch.arange(E + 1, E + 1 + len(new))
    H, d = wk.shape[1:]
    wk = torch.cat([wk, torch.randn(len(new), H, d, generator=gen).to(torch.bfloat16)])
    wv = torch.cat([wv, torch.randn(len(new), H, d, generator=gen).to(torch.bfloat16)])
    starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()
    outside = set()  # kept slots with an entry that some request reads at a position outside its window
    for b, S in enumerate(seq_lens):
        sl = slots[starts[b]:starts[b + 1]]
        out = ~in_window(torch.arange(S), S, cfg.sink_window, cfg.recent_window) & (kept[sl] != 0) & (entry_of[sl] > 0)
        outside |= set(sl[out].tolist())
    return kept, (entry_of, wk, wv), outside


@pytest.mark.parametrize("scale,windows,H,Hq,d,seq_lens,split_tokens", [
    ("shared", (4, 8), 3, 9, 16, [1, 5, 97, 0, 40], None),
    ("none", (4, 8), 1, 4, 32, [70, 2, 33], 7),
    ("per_head", (0, 5), 2, 4, 16, [20, 9, 12], 3),  # recent only
    ("shared", (3, 0), 2, 4, 16, [20, 2, 7], 1),  # sink only
    ("shared", (0, 0), 2, 6, 16, [33, 4, 70], 16),  # empty windows: kept slots are the only exact reads
    ("shared/2", (4, 8), 4, 8, 16, [5, 40, 33], 40),
    ("shared", (4, 8), 1, 3, 16, [300], None),  # one request over several splits
    ("per_head", (1, 1), 2, 2, 8, [0, 3, 1, 260, 17], 256),  # empty and 1-token requests, splits of 256
])
def test_decode_attention_reads_kept_slots_exactly(scale, windows, H, Hq, d, seq_lens, split_tokens):
    """Kept slots with an entry are read exactly at any position, window positions as before,
    everything else (kept slots without an entry included) from codes: the kernel equals the
    reference; a uint8, bool or numpy kept give one answer; kept slots outside the windows
    change it; kept=None, an empty kept and an all-zero kept equal the window rule bit for bit,
    and so does keeping only slots every request holding them reads in its window anyway."""
    sink, recent = windows
    scale, _, groups = scale.partition("/")
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, scale=scale,
                     scale_groups=int(groups or 1), sink_window=sink, recent_window=recent)
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, H, Hq, d, seq_lens, 13, True)
    kept, win, outside = _kept_case(win, slots, seq_lens, cfg, 17)
    assert outside  # the case keeps slots outside the windows, with entries
    entry_of, wk, wv = win
    sm_scale = d ** -0.5
    cos, sin = cos_sin(torch.arange(max(seq_lens) + 3), cb.inv_freq, cb.attention_scaling)
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    tab = cpu.DecodeTables(cb, 0)
    plan = cpu.DecodePlan(indptr, slots, cfg, kb, Hq, H, d, cos, sin, entry_of, split_tokens)
    wk4, wv4 = wk.unsqueeze(1), wv.unsqueeze(1)

    ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, H, d, sm_scale, kept)
    got = plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4, kept)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4, kept=kept != 0), got)
    assert torch.equal(plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4, kept=kept.numpy()), got)
    assert torch.equal(plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4, kept=torch.cat([kept, kept])), got)

    plain = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, H, d, sm_scale)
    assert float((plain - ref).abs().max()) > 1e-3  # the kept slots matter
    base = plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4)
    torch.testing.assert_close(base, plain, rtol=2e-5, atol=2e-5)
    for none in (None, torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.bool),
                 torch.zeros_like(kept), np.zeros(0, np.uint8)):
        assert torch.equal(plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4, kept=none), base)
    starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()
    inside = torch.ones(kept.shape[0], dtype=torch.bool)  # slots read in the window by every request holding them
    for b, S in enumerate(seq_lens):
        sl = slots[starts[b]:starts[b + 1]]
        inside[sl[~in_window(torch.arange(S), S, sink, recent)]] = False
    only_inside = kept * inside.to(torch.uint8)
    assert torch.equal(plan(q, k_rows, v_rows, tab, sm_scale, wk4, wv4, kept=only_inside), base)

    # batch invariance holds with kept slots: each request alone gives its batch answer bit for bit
    for b in range(len(seq_lens)):
        one = cpu.DecodePlan(torch.tensor([0, seq_lens[b]]), slots[starts[b]:starts[b + 1]], cfg, kb, Hq, H, d,
                             cos, sin, entry_of, split_tokens)
        assert torch.equal(one(q[b:b + 1], k_rows, v_rows, tab, sm_scale, wk4, wv4, kept)[0], got[b])


def test_decode_plan_kept_is_per_call_and_checked():
    """``kept`` is given per call (one plan, layers with and without kept slots) and read
    through a view; it is ignored without windows; a kept of another dtype, non-contiguous,
    not 1-D or not covering every slot is refused."""
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8,
                     sink_window=2, recent_window=4)
    seq_lens = [30, 9, 21]
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, 2, 4, 16, seq_lens, 8, True)
    kept, win, _ = _kept_case(win, slots, seq_lens, cfg, 4)
    entry_of, wk, wv = win
    wk4, wv4 = wk.unsqueeze(1), wv.unsqueeze(1)
    cos, sin = cos_sin(torch.arange(40), cb.inv_freq, cb.attention_scaling)
    tab = cpu.DecodeTables(cb, 0)
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    plan = cpu.DecodePlan(indptr, slots, cfg, kb, 4, 2, 16, cos, sin, entry_of)

    def ref(k):
        return _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, 2, 16, 0.25, k)

    live = torch.zeros_like(kept)
    base = plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4, live)
    torch.testing.assert_close(base, ref(None), rtol=2e-5, atol=2e-5)
    live.copy_(kept)  # the same tensor, updated in place: seen on the next call
    got = plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4, live)
    torch.testing.assert_close(got, ref(kept), rtol=2e-5, atol=2e-5)
    assert torch.equal(plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4), base)  # the next layer keeps none
    half = kept.clone()
    half[::2] = 0
    torch.testing.assert_close(plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4, half), ref(half), rtol=2e-5, atol=2e-5)

    bare = cpu.DecodePlan(indptr, slots, cfg, kb, 4, 2, 16, cos, sin)  # no windows: codes everywhere
    assert torch.equal(bare(q, k_rows, v_rows, tab, 0.25, kept=kept), bare(q, k_rows, v_rows, tab, 0.25))
    torch.testing.assert_close(bare(q, k_rows, v_rows, tab, 0.25, kept=kept),
                               _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, None, 2, 16, 0.25),
                               rtol=2e-5, atol=2e-5)

    for bad in (kept.to(torch.int32), kept.float(), torch.stack([kept, kept], 1)[:, 0], kept.view(1, -1),
                kept.numpy().astype(np.int8), [0, 1]):
        with pytest.raises(TypeError, match="kept"):
            plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4, bad)
        with pytest.raises(TypeError, match="kept"):
            bare(q, k_rows, v_rows, tab, 0.25, kept=bad)
    with pytest.raises(ValueError, match="kept"):
        plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4, kept[:int(slots.max())])
    assert torch.equal(plan(q, k_rows, v_rows, tab, 0.25, wk4, wv4, kept[:int(slots.max()) + 1]), got)


# coded exact stores (fp8, res4): ragged requests, both scale modes, a long split request
STORE_CASES = [
    ("shared", (4, 8), 3, 9, 16, [1, 5, 97, 0, 40]),
    ("per_head", (0, 5), 2, 4, 32, [20, 9, 12]),
    ("shared", (4, 8), 1, 2, 16, [700, 60]),
]


@pytest.mark.parametrize("split_tokens", [None, 5])
@pytest.mark.parametrize("scale,windows,H,Hq,d,seq_lens", STORE_CASES)
def test_decode_attention_reads_fp8_entries(scale, windows, H, Hq, d, seq_lens, split_tokens):
    """An fp8 exact store (``exact_format="fp8"``: uint8 float8_e4m3fn codes, one fp16 scale per
    (entry, head)) is read as code x scale, window and kept slots alike: the kernel equals the
    reference fed the decoded entries (:func:`salient.fp8_decode`), and differs from reading the
    bf16 entries the codes were made from; bf16 entries with scales given are refused."""
    from sglang_tasq.salient import fp8_decode, fp8_encode

    sink, recent = windows
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, scale=scale,
                     sink_window=sink, recent_window=recent)
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, H, Hq, d, seq_lens, 21, True)
    kept, win, _ = _kept_case(win, slots, seq_lens, cfg, 5)
    entry_of, wk, wv = win
    (k8, ks), (v8, vs) = fp8_encode(wk.float() * 3.0), fp8_encode(wv.float() * 0.02)  # two magnitudes
    dec = (entry_of, fp8_decode(k8, ks), fp8_decode(v8, vs))
    sm_scale = d ** -0.5
    cos, sin = cos_sin(torch.arange(max(seq_lens) + 3), cb.inv_freq, cb.attention_scaling)
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    tab = cpu.DecodeTables(cb, 0)
    plan = cpu.DecodePlan(indptr, slots, cfg, kb, Hq, H, d, cos, sin, entry_of, split_tokens)
    for kp in (None, kept):
        ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, dec, H, d, sm_scale, kp)
        got = plan(q, k_rows, v_rows, tab, sm_scale, k8.unsqueeze(1), v8.unsqueeze(1), kept=kp, win_scales=(ks, vs))
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
        views = (k8.unsqueeze(1).numpy(), v8.unsqueeze(1).numpy(), ks.view(torch.int16).numpy().view(np.uint16),
                 vs.view(torch.int16).numpy().view(np.uint16))  # the pool's long-lived numpy views
        assert torch.equal(plan(q, k_rows, v_rows, tab, sm_scale, views[0], views[1], kept=kp,
                                win_scales=views[2:]), got)
        bf = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q,
                        (entry_of, (wk.float() * 3).bfloat16(), (wv.float() * 0.02).bfloat16()), H, d, sm_scale, kp)
        assert float((bf - ref).abs().max()) > 1e-6  # fp8 entries are not the bf16 ones
    with pytest.raises(TypeError, match="uint8"):
        plan(q, k_rows, v_rows, tab, sm_scale, wk.unsqueeze(1), wv.unsqueeze(1), win_scales=(ks, vs))


@pytest.mark.parametrize("split_tokens", [None, 5])
@pytest.mark.parametrize("scale,windows,H,Hq,d,seq_lens", STORE_CASES)
def test_decode_attention_reads_res4_entries(scale, windows, H, Hq, d, seq_lens, split_tokens):
    """A res4 exact store (``exact_format="res4"``: uint8 [E + 1, H, d / 2] nibbles of the residual
    over the slot's own codes, one fp16 scale per (entry, head)) is read as the slot's codes plus
    the residual, window and kept slots alike: the kernel equals the reference fed the decoded
    entries (:func:`salient.res4_decode` over the codes' reading, pre-RoPE, native order), which
    lie within half a step of the bf16 entries they were made from; a misshaped or mislabelled
    store is refused."""
    from sglang_tasq.salient import res4_decode, res4_encode

    sink, recent = windows
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, scale=scale,
                     sink_window=sink, recent_window=recent)
    cb, kb, k_rows, v_rows, slots, q, win = _pool_case(cfg, H, Hq, d, seq_lens, 21, True)
    kept, win, _ = _kept_case(win, slots, seq_lens, cfg, 5)
    entry_of, wk, wv = win
    E = wk.shape[0] - 1
    slot_of = torch.zeros(E + 1, dtype=torch.int64)  # entry -> its slot (entry 0 and orphans: slot 0)
    has = torch.nonzero(entry_of > 0).flatten()
    slot_of[entry_of[has]] = has
    Gk, Gv = d // cfg.group_size_k, d // cfg.group_size_v
    kr = k_rows[slot_of]
    kc = packing.unpack_codes(kr[:, :kb].contiguous(), H * Gk, cfg.code_bits_k).view(E + 1, H, Gk)
    sc = None
    if cfg.scale != "none":
        sc = torch.empty(E + 1, kr.shape[1] - kb, dtype=torch.uint8).copy_(kr[:, kb:]).view(torch.float16).reshape(E + 1, -1)
    coded_k = codec.decode_keys(kc, sc, cb, 0)
    coded_v = codec.decode_values(packing.unpack_codes(v_rows[slot_of], H * Gv, cfg.code_bits_v).view(E + 1, H, Gv), cb, 0)
    (k4, ks), (v4, vs) = res4_encode(wk.float(), coded_k), res4_encode(wv.float(), coded_v)
    dk, dv = res4_decode(k4, ks, coded_k), res4_decode(v4, vs, coded_v)
    assert float(((dk - wk.float()).abs() - 0.5 * ks.float()[..., None] * 1.01).max()) <= 1e-6
    sm_scale = d ** -0.5
    cos, sin = cos_sin(torch.arange(max(seq_lens) + 3), cb.inv_freq, cb.attention_scaling)
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    tab = cpu.DecodeTables(cb, 0)
    plan = cpu.DecodePlan(indptr, slots, cfg, kb, Hq, H, d, cos, sin, entry_of, split_tokens)
    for kp in (None, kept):
        ref = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, (entry_of, dk, dv), H, d, sm_scale, kp)
        got = plan(q, k_rows, v_rows, tab, sm_scale, k4.unsqueeze(1), v4.unsqueeze(1), kept=kp, win_scales=(ks, vs),
                   win_format="res4")
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
        codes_only = _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q,
                                (entry_of, coded_k, coded_v), H, d, sm_scale, kp)
        assert float((codes_only - ref).abs().max()) > 1e-4  # the residual is read
    with pytest.raises(ValueError, match="width"):  # fp8-shaped entries labelled res4
        plan(q, k_rows, v_rows, tab, sm_scale, torch.zeros(E + 1, 1, H, d, dtype=torch.uint8),
             torch.zeros(E + 1, 1, H, d, dtype=torch.uint8), win_scales=(ks, vs), win_format="res4")
    with pytest.raises(ValueError, match="need win_scales"):
        plan(q, k_rows, v_rows, tab, sm_scale, k4.unsqueeze(1), v4.unsqueeze(1), win_format="res4")
