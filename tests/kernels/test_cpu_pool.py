"""The Numba CPU kernels inside real TaSQTokenToKVPools and the TaSQ attention backend (built
through their constructors, ``tests/kernels/_pools.py``): kernel decode vs torch decode on one
pool, the fused pool encoder vs the pool's plain-torch path, small (decode-step) batches."""
import pytest
import torch

from numba_kernels import cpu
from sglang_tasq.config import TaSQConfig
from sglang_tasq.testing import random_codebooks


# a per-layer key rate (calibrate --mix-layers): layer 1's keys in groups of 4 of 16 codewords
# (4 bytes of key codes per row against layer 0's 3), so every path reads each layer's own width
MIXED = dict(mix_layers=(1,), mix_group_size_k=4, mix_codebook_size_k=16)


def _tasq_pools(window_rows: int, kernels: tuple = (True, True), req_rows: int | None = None, mixed: bool = False,
                exact_format: str = "bf16"):
    """One real TaSQTokenToKVPool per ``kernels`` flag (its ``ServeOptions.cpu_kernels``: Numba
    kernels, or the plain-torch path; 96 slots, 2 layers, 2 KV heads of 16, sink 2, recent 3)
    sized for ``window_rows`` running requests, and (with ``req_rows``) one ReqToTokenPool
    with that many rows, not yet attached to any pool. ``mixed``: layer 1 at a second key rate;
    ``exact_format``: how the exact store holds its copies."""
    from _pools import make_pool, make_request_rows

    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, sink_window=2, recent_window=3,
                     exact_format=exact_format, **(MIXED if mixed else {}))
    cb = random_codebooks(2, 2, 16, cfg, seed=3)
    cb.k_codebook = (tuple(c.half().float() for c in cb.k_codebook) if mixed else cb.k_codebook.half().float())
    cb.v_codebook = cb.v_codebook.half().float()
    pools = [make_pool(cb, 96, window_rows, cpu_kernels=k) for k in kernels]
    for pool in pools:
        assert pool.exact.capacity == window_rows * (2 + 2 * 3)
    return pools, (make_request_rows(req_rows) if req_rows is not None else None)


@pytest.mark.parametrize("mixed,fmt", [(False, "bf16"), (True, "bf16"), (False, "fp8"), (False, "res4")],
                         ids=["one_key_rate", "per_layer_key_rate", "fp8_store", "res4_store"])
def test_backend_decode_kernel_matches_torch_path_on_a_real_pool(mixed, fmt):
    """The backend's kernel decode and its torch decode read the same TaSQTokenToKVPool: ragged
    requests, a radix-shared prefix (its sink and tail read from the entries its first writer
    made), entries gone stale outside the window or evicted (LRU, the store is sized to its
    limit) read from codes, in-window tokens from their entries; with a per-layer key rate
    each layer's rows at its own width; with an fp8 store its codes and scales."""
    import types

    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_tasq.srt.backend import TaSQAttnBackend

    (pool,), r2t_pool = _tasq_pools(window_rows=3, kernels=(True,), req_rows=3, mixed=mixed, exact_format=fmt)
    assert pool.exact.fmt == fmt and pool.exact.k[0].dtype == (torch.bfloat16 if fmt == "bf16" else torch.uint8)
    if mixed:
        assert [b.shape[1] for b in pool.k_buffer] == [3 + 2, 4 + 2]  # key codes + the fp16 scale
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
                    pool.tasq_config, pool.code_bytes_k_of[lid], *(t.squeeze(1) for t in be_k._cos_sin(max(lens), "cpu")),
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


@pytest.mark.parametrize("mixed", [False, True], ids=["one_key_rate", "per_layer_key_rate"])
def test_pool_encoder_writes_what_the_reference_path_writes(mixed):
    """Fused Numba encode (un-rotate, tailor, scale, nearest, pack, exact window entries) vs the
    pool's plain-torch path, token by token, on two real TaSQTokenToKVPools (with a per-layer key
    rate: layer 1 at the second rate, layer 0 at the first)."""
    import types

    (pool_n, pool_t), _ = _tasq_pools(window_rows=2, kernels=(True, False), mixed=mixed)
    assert pool_n._encoder is not None and pool_t._encoder is None
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


@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "torch"])
def test_fp8_store_holds_the_encoded_copies(kernels):
    """An fp8 exact store (``exact_format="fp8"``) holds, for each in-window token, the fp8 codes
    and fp16 scales of :func:`salient.fp8_encode` of its pre-RoPE key and its value, written the
    same by the fused encoder's pool and the plain-torch one; ``read_exact`` and ``as_stored``
    return the decoded copy (one rounding for every reader); the store's bytes are those
    ``windows.entry_bytes`` charges for fp8 and ~half of bf16's."""
    import types

    from sglang_tasq import windows
    from sglang_tasq.rope import apply_rope
    from sglang_tasq.salient import fp8_decode, fp8_encode

    (pool, ref), _ = _tasq_pools(window_rows=2, kernels=(kernels, False), exact_format="fp8")
    (bf,), _ = _tasq_pools(window_rows=2, kernels=(False,))
    assert (pool._encoder is not None) == kernels
    gen = torch.Generator().manual_seed(12)
    T = 40
    positions = torch.cat([torch.arange(30), torch.arange(500, 510)])
    req_rows = torch.cat([torch.zeros(30), torch.ones(10)]).long()
    seq_lens = torch.cat([torch.full((30,), 30), torch.full((10,), 510)])
    loc = torch.randperm(95, generator=gen)[:T] + 1
    k = (torch.randn(T, 32, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(T, 32, generator=gen).to(torch.bfloat16)
    for p in (pool, ref):
        p.set_kv_buffer(types.SimpleNamespace(layer_id=1), loc, k, v, positions=positions, req_rows=req_rows,
                        seq_lens=seq_lens)
    inw = pool.in_window(positions, seq_lens)
    ent = pool.exact.entry_of[loc[inw]]
    assert int(inw.sum()) == 8 and bool((ent > 0).all()) and torch.equal(pool.exact.entry_of, ref.exact.entry_of)
    cb = pool.codebooks
    k_pre = apply_rope(k.view(T, 2, 16)[inw], positions[inw], cb.inv_freq, cb.attention_scaling, inverse=True)
    (kc, ks), (vc, vs) = fp8_encode(k_pre), fp8_encode(v.view(T, 2, 16)[inw])
    ex = pool.exact
    assert torch.equal(ex.k[1][ent], kc) and torch.equal(ex.k_scale[1][ent], ks)
    assert torch.equal(ex.v[1][ent], vc) and torch.equal(ex.v_scale[1][ent], vs)
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(getattr(ex, name)[1], getattr(ref.exact, name)[1])
    kr, vr = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    pool.read_exact(1, loc[inw], kr, vr, torch.ones(8, dtype=torch.bool))
    assert torch.equal(kr, fp8_decode(kc, ks)) and torch.equal(vr, fp8_decode(vc, vs))
    ks2, vs2 = pool.as_stored(k_pre, v.view(T, 2, 16)[inw])
    assert torch.equal(ks2, kr) and torch.equal(vs2, vr)
    assert float((kr - k_pre).abs().max()) > 0  # fp8, not a copy
    per = windows.entry_bytes(2, 16, 2, "fp8")
    assert per == 2 * 2 * (16 + 2) * 2 + 25 and per - 25 < (windows.entry_bytes(2, 16, 2) - 25) * 0.6
    store = ex.nbytes() - bf.exact.nbytes()
    assert store == (ex.capacity + 1) * (per - windows.entry_bytes(2, 16, 2))



@pytest.mark.parametrize("T", [5, 70], ids=["decode_step", "batched"])
def test_res4_store_completes_the_codes_it_just_wrote(T):
    """A res4 exact store written by the fused encoder (the serial decode-step kernel below 64
    tokens, the batched kernels above) holds, for each in-window token, what
    :func:`salient.res4_encode` makes of its pre-RoPE key and value over what that token's codes
    read as (``pool.read_codes``, the reference decode), bit for bit; the plain-torch pool holds
    the same wherever the two wrote the same codes (they differ only on a float near-tie); the
    salient echo's Numba reader of those entries (``pool.exact_keys``) reads what the store reads."""
    import types

    from sglang_tasq.rope import apply_rope
    from sglang_tasq.salient import res4_encode

    (pool, ref), _ = _tasq_pools(window_rows=8, kernels=(True, False), exact_format="res4")
    gen = torch.Generator().manual_seed(21)
    n0, n1 = T - min(10, T // 2), min(10, T // 2)  # request 0: the first tokens; request 1: ten at 900
    positions = torch.cat([torch.arange(n0), torch.arange(900, 900 + n1)])
    req_rows = torch.cat([torch.zeros(n0), torch.ones(n1)]).long()
    seq_lens = torch.cat([torch.full((n0,), n0), torch.full((n1,), 900 + n1)])
    loc = torch.randperm(95, generator=gen)[:T] + 1
    k = (torch.randn(T, 32, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(T, 32, generator=gen).to(torch.bfloat16)
    for p in (pool, ref):
        p.set_kv_buffer(types.SimpleNamespace(layer_id=1), loc, k, v, positions=positions, req_rows=req_rows,
                        seq_lens=seq_lens)
    inw = pool.in_window(positions, seq_lens)
    ent = pool.exact.entry_of[loc[inw]]
    assert bool((ent > 0).all()) and torch.equal(pool.exact.entry_of, ref.exact.entry_of)
    cb = pool.codebooks
    k_pre = apply_rope(k.view(T, 2, 16)[inw], positions[inw], cb.inv_freq, cb.attention_scaling, inverse=True)
    same = torch.ones(int(inw.sum()), dtype=torch.bool)
    for p in (pool, ref):
        kc, vc = p.read_codes(1, loc[inw])
        (kn, ks), (vn, vs) = res4_encode(k_pre, kc), res4_encode(v.view(T, 2, 16)[inw].float(), vc)
        ex = p.exact
        assert torch.equal(ex.k[1][ent], kn) and torch.equal(ex.k_scale[1][ent], ks)
        assert torch.equal(ex.v[1][ent], vn) and torch.equal(ex.v_scale[1][ent], vs)
        same &= (p.k_buffer[1][loc[inw]] == pool.k_buffer[1][loc[inw]]).all(1)
        same &= (p.v_buffer[1][loc[inw]] == pool.v_buffer[1][loc[inw]]).all(1)
    assert float(same.float().mean()) >= 0.8
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(getattr(pool.exact, name)[1][ent[same]], getattr(ref.exact, name)[1][ent[same]])
    assert bool((pool.exact.k[1][ent] != 0x88).any())  # residuals, not all zero steps
    # the echo's reader (one Numba call on the CPU kernels) returns the store's reading, bit for bit
    mixed = torch.cat([ent.flip(0), ent[:3]])
    assert torch.equal(pool.exact_keys(1, mixed), pool.exact.read_k(1, mixed))
    assert torch.equal(ref.exact_keys(1, mixed), ref.exact.read_k(1, mixed))  # (torch pool: the store's own)
    # an extend's read over codes it has decoded already completes them: the store's own reading
    kd, vd = pool.read_codes(1, loc)
    use = inw.clone()
    use[0] = False
    kr, vr = kd.clone(), vd.clone()
    pool.read_exact(1, loc, kr, vr, use, coded=True)
    want_k, want_v = pool.exact.read(1, pool.exact.entry_of[loc[use]])
    assert torch.equal(kr[use], want_k) and torch.equal(vr[use], want_v)
    assert torch.equal(kr[~use], kd[~use]) and torch.equal(vr[~use], vd[~use])

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


@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "torch"])
def test_per_layer_key_rate_pool_stores_the_reference_codes(kernels):
    """A per-layer key rate in a real pool: each layer's rows hold the reference codec's codes at
    that layer's rate (``codec.encode_keys`` / ``encode_values`` with the mixed codebooks), and
    reading them back decodes as ``codec.decode_keys`` / ``decode_values`` does."""
    import types

    from sglang_tasq import codec, packing
    from sglang_tasq.rope import apply_rope

    (pool,), _ = _tasq_pools(window_rows=2, kernels=(kernels,), mixed=True)
    cb = pool.codebooks
    gen = torch.Generator().manual_seed(11)
    T = 40
    positions = torch.arange(T) + 500  # outside the sink, all past the recent window of a 1000-token request
    loc = torch.randperm(95, generator=gen)[:T] + 1
    k = torch.randn(T, 2, 16, generator=gen) * 3
    v = torch.randn(T, 2, 16, generator=gen)
    seq = torch.full((T,), 1000)
    for lid in (0, 1):
        pool.set_kv_buffer(types.SimpleNamespace(layer_id=lid), loc, k.reshape(T, 32), v.reshape(T, 32),
                           positions=positions, req_rows=torch.zeros(T, dtype=torch.long), seq_lens=seq)
        k_pre = apply_rope(k, positions, cb.inv_freq, cb.attention_scaling, inverse=True)
        kc, scale = codec.encode_keys(k_pre, cb, lid)
        vc = codec.encode_values(v, cb, lid)
        g = 4 if lid == 1 else 8
        assert kc.shape == (T, 2, 16 // g)
        want_row = packing.pack_codes(kc.reshape(T, -1), cb.config.code_bits_k_at(lid))
        got_row = pool.k_buffer[lid][loc]
        same = (got_row[:, : want_row.shape[1]] == want_row).all(1).float().mean().item()
        assert got_row.shape[1] == want_row.shape[1] + 2 and same >= 0.95, same  # near-ties aside
        k_dec, v_dec = pool.read_codes(lid, loc)
        ok = (got_row[:, : want_row.shape[1]] == want_row).all(1)
        torch.testing.assert_close(k_dec[ok], codec.decode_keys(kc, scale, cb, lid)[ok], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_dec, codec.decode_values(vc, cb, lid), atol=1e-5, rtol=1e-5)
