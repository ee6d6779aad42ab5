"""Numba CPU kernels (numba_kernels.cpu) against the plain-torch reference codec, on awkward shapes."""
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


def _distances(x, codebook):
    """[T, H, G, K] squared distances, float64."""
    return ((x.double().unsqueeze(3) - codebook.double().unsqueeze(0)) ** 2).sum(-1)


# (1, .., 8): one-token path; (5, .., 8): 4-token block + tail; >= 64 with g == 8: the lane
# kernel (odd K, T not a multiple of its 64-token block); the rest: the generic kernels
@pytest.mark.parametrize("T,H,G,K,g", [(1, 1, 1, 2, 2), (1, 3, 8, 1024, 8), (5, 2, 2, 100, 8), (37, 3, 5, 33, 4),
                                       (200, 3, 8, 1024, 8), (130, 2, 3, 257, 8), (64, 1, 1, 1, 8),
                                       (90, 2, 3, 64, 4), (17, 2, 3, 256, 16)])
def test_nearest_matches_reference(T, H, G, K, g):
    gen = torch.Generator().manual_seed(T + K)
    cb = torch.randn(H, G, K, g, generator=gen)
    x = torch.randn(T, H, G, g, generator=gen) * 1.3
    ref = codec.nearest_codeword(x, cb)
    got = cpu.nearest(x, cpu.prepare(cb))
    assert got.dtype == torch.int64 and got.shape == ref.shape
    same = (got == ref).float().mean().item()
    assert same >= 0.999
    # wherever the index differs it is a float32 near-tie: the distances agree to rounding
    dist = _distances(x, cb)
    d_got = torch.gather(dist, 3, got.unsqueeze(-1))
    d_min = dist.min(-1, keepdim=True).values
    assert float((d_got - d_min).max()) <= 1e-5 * float(d_min.abs().max() + 1)


@pytest.mark.parametrize("T,g,dup", [(4, 4, (2, 5)), (70, 8, (2, 5)), (70, 8, (6, 7)), (70, 8, (0, 8)), (1, 8, (6, 7))])
def test_nearest_first_index_on_exact_ties(T, g, dup):
    """Duplicated codewords: the first one wins, as in torch.argmin (also when the two sit in
    one codeword pair of the lane kernel, and when the duplicate is the odd last one)."""
    cb = torch.randn(2, 3, max(8, dup[1] + 1), g)  # K = 9: the duplicate is the odd last codeword
    cb[:, :, dup[1]] = cb[:, :, dup[0]]
    x = cb[:, :, dup[0]].unsqueeze(0).repeat(T, 1, 1, 1) + 1e-3
    assert (cpu.nearest(x, cpu.prepare(cb)) == dup[0]).all()


def test_nearest_nonfinite_input_and_empty():
    cb = torch.randn(2, 3, 8, 4)
    x = cb[:, :, 2].unsqueeze(0).repeat(4, 1, 1, 1) + 1e-3
    x[1, 0, 0, 0] = float("nan")
    x[2, 1, 2, 3] = float("inf")
    assert torch.equal(cpu.nearest(x, cpu.prepare(cb)), codec.nearest_codeword(x, cb))
    assert cpu.nearest(torch.zeros(0, 2, 3, 4), cpu.prepare(cb)).shape == (0, 2, 3)


@pytest.mark.parametrize("bits", [1, 3, 6, 7, 8, 10, 12, 16, 17, 24])
@pytest.mark.parametrize("n", [1, 5, 72])
def test_pack_unpack_bit_exact(bits, n):
    gen = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 1 << bits, (19, n), generator=gen)
    codes[0] = (1 << bits) - 1  # the largest code everywhere
    codes[1] = 0
    ref = packing.pack_codes(codes, bits)
    got = cpu.pack(codes, bits)
    assert torch.equal(got, ref)
    assert torch.equal(cpu.unpack(got, n, bits), packing.unpack_codes(ref, n, bits))
    assert torch.equal(cpu.unpack(got, n, bits), codes)


@pytest.mark.parametrize("bits", [1, 5, 7, 10, 13, 16, 17])
def test_codes_of_reads_any_run_of_codes(bits):
    """The decode kernel's one-pass unpack of codes first..first+n-1 (a head's codes) equals
    the reference unpack for every start and length, on rows of exactly the packed size."""
    from numba import njit

    @njit
    def run(buf, first, n, bits, out):
        for slot in range(buf.shape[0]):
            cpu._codes_of(buf, slot, first, n, bits, out[slot])

    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (4, 11), generator=gen)
    codes[0] = (1 << bits) - 1
    packed = packing.pack_codes(codes, bits).numpy()
    for first in range(11):
        for n in range(1, 12 - first):
            out = np.zeros((4, 12), np.int64)
            run(packed, first, n, bits, out)
            assert (out[:, :n] == codes[:, first:first + n].numpy()).all(), (first, n)


def test_pack_refuses_out_of_range_and_bad_rows():
    with pytest.raises(ValueError, match="out of range"):
        cpu.pack(torch.tensor([[4]]), 2)
    with pytest.raises(ValueError, match="bytes"):
        cpu.unpack(torch.zeros(2, 3, dtype=torch.uint8), 3, 10)


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


def _reference(cb, cfg, k_rows, v_rows, kb, slots, seq_lens, q, win, H, d, sm_scale):
    """Plain-torch codec per request; position t of a request of length S reads its slot's
    entry iff t < sink or t >= S - recent and the slot holds one."""
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
            scale = scale.reshape(S) if cfg.scale == "shared" else scale.reshape(S, H)
        vc = packing.unpack_codes(v_rows[sl], H * Gv, cfg.code_bits_v).view(S, H, Gv)
        pos = torch.arange(S)
        kw = vw = mask = None
        if win is not None:
            entry_of, wk, wv = win
            ent = entry_of[sl]
            mask = in_window(pos, S, cfg.sink_window, cfg.recent_window) & (ent > 0)
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
])
def test_decode_attention_matches_reference(scale, windows, H, Hq, d, seq_lens, split_tokens):
    """Split-K (splits past a short request's end are empty) merges to the unsplit answer;
    window tokens come from their slots' entries, everything else (stale or absent entries
    included) from codes."""
    sink, recent = windows or (0, 0)
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, scale=scale,
                     sink_window=sink, recent_window=recent)
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


def _tasq_pools(window_rows: int, n: int = 2, req_rows: int | None = None):
    """``n`` real TaSQTokenToKVPools (96 slots, 2 layers, 2 KV heads of 16, sink 2, recent 3)
    sized for ``window_rows`` running requests, and (with ``req_rows``) one ReqToTokenPool
    with that many rows, not yet attached to any pool."""
    from _pools import make_pool, make_request_rows

    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, sink_window=2, recent_window=3)
    cb = random_codebooks(2, 2, 16, cfg, seed=3)
    cb.k_codebook, cb.v_codebook = cb.k_codebook.half().float(), cb.v_codebook.half().float()
    pools = [make_pool(cb, 96, window_rows) for _ in range(n)]
    for pool in pools:
        assert pool.exact.capacity == window_rows * (2 + 2 * 3)
    return pools, (make_request_rows(req_rows) if req_rows is not None else None)


def test_backend_decode_kernel_matches_torch_path_on_a_real_pool():
    """The backend's kernel decode and its torch decode read the same TaSQTokenToKVPool: ragged
    requests, a radix-shared prefix (its sink and tail read from the entries its first writer
    made), entries gone stale outside the window or evicted (LRU, the store is sized to its
    limit) read from codes, in-window tokens from their entries."""
    import types

    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_tasq.srt.backend import TaSQAttnBackend

    (pool,), r2t_pool = _tasq_pools(window_rows=3, n=1, req_rows=3)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=r2t_pool, token_to_kv_pool=pool)
    be_k, be_t = TaSQAttnBackend(runner), TaSQAttnBackend(runner)  # one pool, one request table
    be_t._decode_kernel = False
    assert be_k._decode_kernel
    too_many = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    with pytest.raises(RuntimeError, match="4 request rows need 32 full-precision window entries, the store holds 24"):
        pool.attach_request_rows(too_many)  # more rows than the store holds windows for
    rows = r2t_pool.alloc_rows(3)
    layers = [types.SimpleNamespace(layer_id=i, tp_q_head_num=4, tp_k_head_num=2, qk_head_dim=16, v_head_dim=16,
                                    scaling=0.25) for i in range(2)]
    gen = torch.Generator().manual_seed(5)
    free = torch.randperm(95, generator=gen) + 1
    r2t = r2t_pool.req_to_token
    lens, used, worst, decodes, windows_matter = [0, 8, 0], 0, 0.0, 0, 0.0
    steps = [("extend", {0: 9, 2: 4}), ("extend", {0: 3, 1: 2, 2: 1})] + [("decode", {0: 1, 1: 1, 2: 1})] * 4
    for mode, batch in steps:
        new = list(batch.values())
        loc = free[used:used + sum(new)]
        used += sum(new)
        pos, off = [], 0
        for b, t in batch.items():
            if b == 1 and lens[1] == 8:  # request 1 matches request 0's first 8 tokens in the radix cache
                shared = r2t[rows[0], :9].to(torch.int64)
                assert pool.valid_prefix(shared[:4]) == 2  # positions 2, 3 were never exact: cut there
                assert pool.valid_prefix(shared[:8]) == 8  # sink 0, 1 and tail 6, 7 are exact
                r2t[rows[1], :8] = r2t[rows[0], :8]
            r2t[rows[b], lens[b]:lens[b] + t] = loc[off:off + t].to(torch.int32)
            pos += list(range(lens[b], lens[b] + t))
            off += t
        prefix = [lens[b] for b in batch]
        for b, t in batch.items():
            lens[b] += t
        fb = types.SimpleNamespace(req_pool_indices=torch.tensor([rows[b] for b in batch]),
                                   seq_lens=torch.tensor([lens[b] for b in batch], dtype=torch.int32),
                                   extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                                   extend_seq_lens=torch.tensor(new, dtype=torch.int32), positions=torch.tensor(pos),
                                   out_cache_loc=loc.clone(),
                                   forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
        # one forward, one window assignment: be_t reads what be_k's metadata pinned and assigned
        # (a second init_forward_metadata would tick the store's clock and assign again)
        be_k.init_forward_metadata(fb)
        md = be_k.forward_metadata
        assert ("kv_indices" in md) == (mode == "decode")
        be_t.forward_metadata = {k: v for k, v in md.items() if k not in ("kv_indptr", "kv_indices", "plan")}
        for layer in layers:
            N = sum(new)
            q = torch.randn(N, 64, generator=gen)
            k, v = torch.randn(N, 32, generator=gen) * 2, torch.randn(N, 32, generator=gen)
            got = be_k._forward(q, k, v, layer, fb, save_kv_cache=True)
            want = be_t._forward(q, k, v, layer, fb, save_kv_cache=False)
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            if mode == "decode":
                decodes += 1
                # every in-window token of every request has its entry (the torch path checks it),
                # and reading them matters: the same kernel over codes alone differs
                lid = layer.layer_id
                codes_only = cpu.decode_attention(
                    q.view(-1, 4, 16), pool.k_buffer[lid], pool.v_buffer[lid], md["kv_indptr"], md["kv_indices"],
                    be_k._decode_tables[lid] if lid in be_k._decode_tables else cpu.DecodeTables(pool.codebooks, lid),
                    pool.tasq_config, pool.code_bytes_k, *(t.squeeze(1) for t in be_k._cos_sin(max(lens), "cpu")),
                    0.25)
                windows_matter = max(windows_matter, float((codes_only - got.view(-1, 4, 16)).abs().max()))
    assert decodes == 8
    assert worst < 1e-5, worst
    assert windows_matter > 1e-2, windows_matter
    # the store ran full: old entries outside every window were evicted, and after every step
    # the slots of the requests' windows hold entries, the rest of their slots may not
    assert pool.exact.evictions > 0
    assert pool.exact.used() <= pool.exact.capacity
    for b, S in enumerate(lens):
        sl = r2t[rows[b], :S].to(torch.int64)
        inw = pool.in_window(torch.arange(S), S)
        assert bool((pool.exact.entry_of[sl[inw]] > 0).all())
    gone = [int(s) for b, S in enumerate(lens) for s in r2t[rows[b], :S] if not int(pool.exact.entry_of[int(s)])]
    assert gone  # some slots outside the windows (positions 2..5 of request 0 at least) read codes


def test_pool_encoder_writes_what_the_reference_path_writes():
    """Fused Numba encode (un-rotate, tailor, scale, nearest, pack, exact window entries) vs the
    pool's plain-torch path, token by token, on two real TaSQTokenToKVPools."""
    import types

    (pool_n, pool_t), _ = _tasq_pools(window_rows=2)
    assert pool_n._encoder is not None
    pool_t._encoder = None
    layer = types.SimpleNamespace(layer_id=1)
    gen = torch.Generator().manual_seed(9)
    T = 70
    # three requests' tokens: 0..39 of 40 (sink 0, 1 and 37..39 kept), 1000..1019 of 1020
    # (1017..1019 kept), 3..12 of 13 (10..12 kept; the rest outside every window: no entry)
    positions = torch.cat([torch.arange(40), torch.arange(1000, 1020), torch.arange(3, 13)])
    req_rows = torch.cat([torch.zeros(40), torch.ones(20), torch.full((10,), 2)]).long()
    seq_lens = torch.cat([torch.full((40,), 40), torch.full((20,), 1020), torch.full((10,), 13)])
    loc = torch.randperm(95, generator=gen)[:T] + 1
    k = (torch.randn(T, 32, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(T, 32, generator=gen).to(torch.bfloat16)
    for pool in (pool_n, pool_t):
        pool.set_kv_buffer(layer, loc, k, v, positions=positions, req_rows=req_rows, seq_lens=seq_lens)
    kb, vb = pool_n.k_buffer[1][loc], pool_t.k_buffer[1][loc]
    same_rows = (kb == vb).all(1).float().mean().item()
    assert same_rows >= 0.95, same_rows  # a row differs only on a float near-tie (or scale rounding)
    assert torch.equal(kb[:, -2:], vb[:, -2:]) or (kb[:, -2:] != vb[:, -2:]).any(1).sum() <= 1  # fp16 scales
    assert (pool_n.v_buffer[1][loc] == pool_t.v_buffer[1][loc]).all(1).float().mean().item() >= 0.95
    kept = pool_n.in_window(positions, seq_lens)
    assert int(kept.sum()) == 11 and pool_n.exact.used() == pool_t.exact.used() == 11
    assert torch.equal(pool_n.exact.entry_of, pool_t.exact.entry_of)
    assert bool((pool_n.exact.entry_of[loc[kept]] > 0).all()) and bool((pool_n.exact.entry_of[loc[~kept]] == 0).all())
    # the entries (entry 0, "none", included: neither path writes it) hold the same bf16 bits
    assert torch.equal(pool_n.exact.k[1], pool_t.exact.k[1]) and torch.equal(pool_n.exact.v[1], pool_t.exact.v[1])
    assert bool((pool_n.exact.k[1][1:12] != 0).any()) and not bool(pool_n.exact.k[1][0].any())
    # ... the un-rotated keys and the values of the kept tokens
    from sglang_tasq.rope import apply_rope

    cb = pool_t.codebooks
    k_pre = apply_rope(k.view(T, 2, 16).float(), positions, cb.inv_freq, cb.attention_scaling, inverse=True)
    ent = pool_t.exact.entry_of[loc[kept]]
    torch.testing.assert_close(pool_t.exact.k[1][ent].float(), k_pre[kept], rtol=1e-2, atol=1e-2)
    assert torch.equal(pool_t.exact.v[1][ent], v.view(T, 2, 16)[kept])
    # single-token (serial kernels) writes, as in decode; each is its own forward's first layer
    for i in range(3):
        one = slice(i, i + 1)
        for pool in (pool_n, pool_t):
            pool.set_kv_buffer(types.SimpleNamespace(layer_id=0), loc[one], k[one], v[one], positions=positions[one],
                               req_rows=req_rows[one], seq_lens=seq_lens[one])
    assert torch.equal(pool_n.exact.entry_of, pool_t.exact.entry_of)
    assert torch.equal(pool_n.k_buffer[0][loc[:3]], pool_t.k_buffer[0][loc[:3]])
    assert torch.equal(pool_n.exact.k[0], pool_t.exact.k[0]) and torch.equal(pool_n.exact.v[0], pool_t.exact.v[0])
    # a slot rewritten outside the window drops its entry (the token it held is gone); one
    # rewritten inside keeps its entry with the new token's values
    e0, e39 = int(pool_n.exact.entry_of[loc[0]]), int(pool_n.exact.entry_of[loc[39]])
    assert e0 and e39
    for pool in (pool_n, pool_t):
        pool.set_kv_buffer(layer, loc[[0, 39]], k[[5, 6]], v[[5, 6]], positions=torch.tensor([20, 41]),
                           req_rows=torch.tensor([0, 0]), seq_lens=torch.tensor([42, 42]))
        assert int(pool.exact.entry_of[loc[0]]) == 0 and int(pool.exact.entry_of[loc[39]]) == e39
        assert int(pool.exact.owner[e0]) == -1 and pool.exact.used() == 10
    assert torch.equal(pool_n.exact.k[1][e39], pool_t.exact.k[1][e39])
    assert torch.equal(pool_n.exact.v[1][e39], v.view(T, 2, 16)[6])


def test_pool_encoder_small_batches_match_the_batched_kernels_and_refuse_non_finite():
    """A decode step's few tokens go through one call (``_encode_small``): the same
    rows and exact entries as the batched kernels (forced by running the same tokens padded
    past the serial threshold), and a non-finite key or value writes nothing and returns False."""
    import types

    (pool_a, pool_b), _ = _tasq_pools(window_rows=2)
    gen = torch.Generator().manual_seed(4)
    T, pad = 5, cpu._SERIAL_BELOW
    positions = torch.tensor([7, 300, 301, 2, 1019])
    loc = torch.tensor([3, 9, 4, 60, 22])
    keep = torch.tensor([True, True, True, False, True])  # slot 60's token is outside its window
    wr = pool_a.exact.assign(loc, keep)
    assert torch.equal(pool_b.exact.assign(loc, keep), wr) and bool((wr[keep] > 0).all()) and int(wr[3]) == 0
    k = (torch.randn(T + pad, 2, 16, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(T + pad, 2, 16, generator=gen).to(torch.bfloat16)
    cos, sin = pool_a.rope_table(2048)
    zeros = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731

    def args(pool, n, views=False):
        wk, wv = (pool._np["wk"][1], pool._np["wv"][1]) if views else (pool.win_k[1], pool.win_v[1])
        return (k[:n], v[:n], torch.cat([positions, zeros(n - T)]), cos, sin, torch.cat([loc, torch.full((n - T,), 90)]),
                pool.k_buffer[1], pool.v_buffer[1], pool.code_bytes_k, torch.cat([wr, zeros(n - T)]), zeros(n), wk, wv)

    assert pool_a._encoder.encode_into(1, *args(pool_a, T))  # serial: T < threshold
    assert pool_b._encoder.encode_into(1, *args(pool_b, T + pad, views=True))  # batched kernels, numpy views
    assert torch.equal(pool_a.k_buffer[1][loc], pool_b.k_buffer[1][loc])
    assert torch.equal(pool_a.v_buffer[1][loc], pool_b.v_buffer[1][loc])
    assert torch.equal(pool_a.win_k[1], pool_b.win_k[1]) and torch.equal(pool_a.win_v[1], pool_b.win_v[1])
    assert bool((pool_a.k_buffer[1][loc] != 0).any())
    # the kept tokens' values landed in their entries (the pool's [E + 1, 1, H, d] views of the store)
    assert torch.equal(pool_a.exact.v[1][wr[keep]], v[:T][keep])
    assert not bool(pool_a.exact.v[1][0].any())  # entry 0 ("none") is never written
    before = [t.clone() for t in (pool_a.k_buffer[1], pool_a.v_buffer[1], pool_a.win_k[1], pool_a.win_v[1])]
    for bad in ("k", "v"):
        kk, vv = k[:T].clone(), v[:T].clone()
        (kk if bad == "k" else vv)[2, 1, 5] = float("nan")
        a = list(args(pool_a, T))
        a[0], a[1] = kk, vv
        assert pool_a._encoder.encode_into(1, *a) is False
        after = (pool_a.k_buffer[1], pool_a.v_buffer[1], pool_a.win_k[1], pool_a.win_v[1])
        assert all(torch.equal(x, y) for x, y in zip(before, after))
    pool_a.set_kv_buffer(types.SimpleNamespace(layer_id=1), loc[:1], kk[:1], vv[:1], positions=positions[:1],
                         req_rows=torch.tensor([0]), seq_lens=torch.tensor([8]))  # falls back, no error
    assert int(pool_a.exact.entry_of[loc[0]]) == int(wr[0])  # position 7 of 8: still in the window
