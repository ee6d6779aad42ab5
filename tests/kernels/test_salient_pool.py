"""Salient tokens served by the real TaSQ pool and CPU backend (the streaming echo rule of
sglang_tasq.salient): the kept slots are the reference's decision over the window echo of the
exact keys, the same whether a prompt comes in one chunk or several or shares a radix prefix,
layers from the deciding one read them exactly (extend and decode, kernel and torch), and a radix
match is cut before a kept slot whose exact entry is gone. Also the store's room for finished
sequences' windows (with and without salient tokens): what a later radix match of a prompt needs
outlives the requests after it."""
import types

import pytest
import torch

from sglang_tasq import salient as sal
from sglang_tasq.config import TaSQConfig
from sglang_tasq.rope import apply_rope
from sglang_tasq.testing import random_codebooks

H, HQ, D, LAYERS = 2, 4, 16, 3
SINK, BLOCK, BUDGET, DECIDE = 2, 8, 2, 1
RECENT = BLOCK + sal.ECHO_WINDOW // 2 + 1  # the smallest recent window the blocks allow (after=2: reach ahead 1)
T = 130


def _setup(budget=BUDGET, rows=3, size=600, exact_format="bf16", forward_tokens=None, cached_windows=None):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from _pools import make_pool
    from sglang_tasq.srt.backend import TaSQAttnBackend

    cfg = TaSQConfig(codebook_size_k=16, codebook_size_v=16, sink_window=SINK, recent_window=RECENT,
                     salient_budget=budget, salient_block=BLOCK, salient_layer=DECIDE, salient_after=2,
                     exact_format=exact_format)
    cb = random_codebooks(LAYERS, H, D, config=cfg, seed=3)
    pool = make_pool(cb, size=size, window_rows=rows, forward_tokens=forward_tokens, cached_windows=cached_windows)
    r2t = ReqToTokenPool(size=rows, max_context_len=256, device="cpu", enable_memory_saver=False)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool)
    be_k, be_t = TaSQAttnBackend(runner), TaSQAttnBackend(runner)
    be_t._decode_kernel = False
    return pool, r2t, be_k, be_t, cb


def _data(n=T + 8, seed=0):
    """Per layer and position: a query, a key (post-RoPE, as SGLang hands them over) and a value."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(LAYERS, n, HQ * D, generator=g)
    k = torch.randn(LAYERS, n, H * D, generator=g) * 2
    q[:, :, :D] += 3 * k[:, :, :D].roll(40, 1)  # some queries look far back: echoes worth keeping
    v = torch.randn(LAYERS, n, H * D, generator=g)
    return tuple(x.to(torch.bfloat16).float() for x in (q, k, v))  # what a bf16 model hands over


class Runner:
    """Drives one request row through extend chunks and decode steps, as SGLang's scheduler does."""

    def __init__(self, pool, r2t, be, row, free):
        self.pool, self.r2t, self.be, self.row, self.free, self.S = pool, r2t, be, row, free, 0
        self.out = {}  # (layer, position) -> output row

    def forward(self, n, data, decode=False, other=None):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        q, k, v = data
        P, S = self.S, self.S + n
        loc = torch.tensor([self.free.pop(0) for _ in range(n)])
        self.r2t.req_to_token[self.row, P:S] = loc.to(torch.int32)
        fb = types.SimpleNamespace(
            req_pool_indices=torch.tensor([self.row]), seq_lens=torch.tensor([S], dtype=torch.int32),
            extend_prefix_lens=torch.tensor([P], dtype=torch.int32), extend_seq_lens=torch.tensor([n], dtype=torch.int32),
            positions=torch.arange(P, S), out_cache_loc=loc,
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND)
        self.be.init_forward_metadata(fb)
        if other is not None:
            other.forward_metadata = {a: b for a, b in self.be.forward_metadata.items()
                                      if a not in ("kv_indptr", "kv_indices", "plan")}
        for lid in range(LAYERS):
            layer = types.SimpleNamespace(layer_id=lid, tp_q_head_num=HQ, tp_k_head_num=H, qk_head_dim=D,
                                          v_head_dim=D, scaling=D ** -0.5)
            o = self.be._forward(q[lid, P:S], k[lid, P:S], v[lid, P:S], layer, fb, save_kv_cache=True)
            if other is not None:
                want = other._forward(q[lid, P:S], k[lid, P:S], v[lid, P:S], layer, fb, save_kv_cache=False)
                assert torch.allclose(o, want, atol=1e-5, rtol=1e-4)
            for i in range(n):
                self.out[(lid, P + i)] = o[i]
        self.S = S

    def kept(self):
        slots = self.r2t.req_to_token[self.row, :self.S].to(torch.int64)
        return torch.nonzero(self.pool.exact.kept[slots]).flatten().tolist()


def _reference_kept(cb, data, S, exact_format="bf16"):
    """The blocks decided over the first S positions by the plain-torch rule: each query's window
    echo over the exact keys (bf16 pre-RoPE copies, fp8 ones (:func:`salient.fp8_rows`), or res4
    ones over the keys' codes (:func:`salient.res4_rows`), re-rotated), fp16 per (layer, head),
    layers up to the deciding one."""
    from sglang_tasq import codec

    q, k, _ = data
    rows = []
    for lid in range(DECIDE + 1):
        kk = k[lid, :S].view(S, H, D)
        pre = apply_rope(kk, torch.arange(S), cb.inv_freq, cb.attention_scaling, inverse=True)
        if exact_format == "res4":
            pre = sal.res4_rows(pre, codec.decode_keys(*codec.encode_keys(pre, cb, lid), cb, lid))
        else:
            pre = pre.to(torch.bfloat16) if exact_format == "bf16" else sal.fp8_rows(pre)
        post = apply_rope(pre.float(), torch.arange(S), cb.inv_freq, cb.attention_scaling)
        e = sal.query_echo(q[lid, :S].view(S, HQ, D), post, torch.arange(S), torch.arange(S), SINK, RECENT, D ** -0.5)
        rows.append(e.to(torch.float16).float().T)
    return sal.decide_blocks(torch.cat(rows), S, 0, SINK, sal.SalientSpec(BUDGET, shared=True, after=2, rule="echo",
                                                                          block=BLOCK, layer=DECIDE)).tolist()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "res4"])
def test_kept_slots_are_the_reference_decision_whole_chunked_or_shared(fmt):
    """(fp8: the exact store holds fp8 copies, ``exact_format``: the echo reads them; res4: the
    codes plus a 4-bit residual.)"""
    pool, r2t, be_k, be_t, cb = _setup(exact_format=fmt)
    data = _data()
    free = list(range(1, 600))
    rows = r2t.alloc_rows(3)
    whole = Runner(pool, r2t, be_k, rows[0], free)
    whole.forward(T, data)
    pieces = Runner(pool, r2t, be_k, rows[1], free)
    for n in (37, 1, 50, 42):
        pieces.forward(n, data, other=be_t)
    want = _reference_kept(cb, data, T, fmt)
    assert len(want) == BUDGET * sal.decided_blocks(T, pool.salient) and min(want) >= SINK
    if fmt != "bf16":
        assert pool.exact.fmt == fmt and pool.exact.k_scale is not None
    assert whole.kept() == want and pieces.kept() == want
    # the same attention, whole or chunked; the deciding layer and after read the kept tokens
    for lid in range(LAYERS):
        for p in range(T):
            assert torch.allclose(whole.out[(lid, p)], pieces.out[(lid, p)], atol=1e-5), (lid, p)
    for _ in range(3):  # decode: the kernel against the torch reader, same answers for both requests
        for run in (whole, pieces):
            run.forward(1, data, decode=True, other=be_t)
    for p in range(T, T + 3):
        for lid in range(LAYERS):
            assert torch.allclose(whole.out[(lid, p)], pieces.out[(lid, p)], atol=1e-4)
    # a request sharing the first 100 slots through the radix cache continues the same decisions
    shared = Runner(pool, r2t, be_k, rows[2], free)
    r2t.req_to_token[rows[2], :100] = r2t.req_to_token[rows[0], :100]
    assert pool.valid_prefix(r2t.req_to_token[rows[2], :100].to(torch.int64)) == 100
    shared.S = 100
    shared.forward(T - 100, data, other=be_t)
    assert shared.kept() == want
    for p in range(100, T):
        assert torch.allclose(shared.out[(2, p)], whole.out[(2, p)], atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "res4"])
def test_decode_steps_decide_blocks_as_the_reference(fmt):
    """Blocks whose horizon a decode step reaches: decided from the echo the decode kernel gives
    with its attention (recorded and decided after the deciding layer's attention) as from the
    torch reader's echo (before it), and both as the plain-torch reference; the attention of
    every step the same on both paths."""
    data = _data(n=T + 30)
    runs = []
    for kernel in (True, False):
        pool, r2t, be_k, be_t, cb = _setup(exact_format=fmt)
        run = Runner(pool, r2t, be_k if kernel else be_t, r2t.alloc_rows(1)[0], list(range(1, 600)))
        run.forward(60, data)
        for _ in range(60):
            run.forward(1, data, decode=True)
        assert max(run.kept()) >= 60 + BLOCK  # blocks of decoded tokens were decided by decode steps
        assert run.kept() == _reference_kept(cb, data, run.S, fmt)
        runs.append(run)
    for key, o in runs[0].out.items():
        assert torch.allclose(o, runs[1].out[key], atol=1e-4), key


def test_kept_tokens_change_what_the_deciding_layer_reads_and_nothing_before():
    """Against a pool without salient tokens: layers before the deciding one and queries before the
    first block's horizon are unchanged; past it, the deciding layer's outputs move."""
    data = _data(seed=1)
    outs = []
    for budget in (BUDGET, 0):
        pool, r2t, be_k, be_t, cb = _setup(budget=budget)
        run = Runner(pool, r2t, be_k, r2t.alloc_rows(1)[0], list(range(1, 600)))
        run.forward(T, data)
        for _ in range(2):
            run.forward(1, data, decode=True, other=be_t)
        outs.append(run.out)
    on, off = outs
    h0 = sal.block_horizon(0, sal.SalientSpec(BUDGET, shared=True, after=2, rule="echo", block=BLOCK))
    assert all(torch.equal(on[(0, p)], off[(0, p)]) for p in range(T + 2))
    assert all(torch.allclose(on[(DECIDE, p)], off[(DECIDE, p)], atol=1e-6) for p in range(h0))
    moved = max(float((on[(DECIDE, p)] - off[(DECIDE, p)]).abs().max()) for p in range(h0, T + 2))
    assert moved > 1e-2


def test_a_match_is_cut_before_a_kept_slot_without_its_entry():
    pool, r2t, be_k, be_t, cb = _setup()
    run = Runner(pool, r2t, be_k, r2t.alloc_rows(1)[0], list(range(1, 600)))
    run.forward(T, _data(seed=2))
    slots = r2t.req_to_token[run.row, :T].to(torch.int64)
    kept = run.kept()
    assert pool.valid_prefix(slots) == T
    victim = kept[3]
    pool.exact.release_slots(slots[victim:victim + 1])  # as LRU eviction would
    assert pool.valid_prefix(slots) <= victim
    assert int(pool.exact.kept[slots[victim]]) == 1  # the flag stays: the slot's token was chosen


def test_salient_config_is_checked():
    with pytest.raises(ValueError, match="recent window >= 41"):
        TaSQConfig(salient_budget=2, salient_block=8, recent_window=40)
    cfg = TaSQConfig(salient_budget=2, salient_block=8, salient_layer=5)
    with pytest.raises(ValueError, match="salient_layer=5"):
        cfg.check_layers(3)
    assert TaSQConfig().salient_spec() is None


@pytest.mark.parametrize("lens,fmt", [((T, 37), "bf16"), ((5, 90), "bf16"), ((1, 2), "bf16"), ((T, 37), "fp8"),
                                      ((T, 3), "res4")])
def test_batched_decode_echo_equals_the_per_request_echo(lens, fmt):
    """A decode batch's window echo, all requests at once, equals salient.query_echo request by
    request (short requests inside the sink, long ones past the window); so does the echo the
    decode kernel gives with its attention (``DecodePlan(echo_span=)``), with one split per
    request or the windows spread over splits of 16 positions (the attention output then the
    kernel's without the echo, bit for bit)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from numba_kernels import cpu

    pool, r2t, be_k, be_t, cb = _setup(exact_format=fmt)
    data = _data()
    free = list(range(1, 600))
    rows = r2t.alloc_rows(2)
    runs = [Runner(pool, r2t, be_k, rows[b], free) for b in range(2)]
    for run, n in zip(runs, lens):
        run.forward(n, data)
    loc = torch.tensor([free.pop(0) for _ in range(2)])
    for run, s in zip(runs, loc):
        r2t.req_to_token[run.row, run.S] = int(s)
    fb = types.SimpleNamespace(
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor([r.S + 1 for r in runs], dtype=torch.int32),
        extend_prefix_lens=None, extend_seq_lens=None, positions=torch.tensor([r.S for r in runs]), out_cache_loc=loc,
        forward_mode=ForwardMode.DECODE)
    be_k.init_forward_metadata(fb)
    md = be_k.forward_metadata
    q, k, v = data
    for lid in range(DECIDE + 1):
        layer = types.SimpleNamespace(layer_id=lid, tp_q_head_num=HQ, tp_k_head_num=H, qk_head_dim=D,
                                      v_head_dim=D, scaling=D ** -0.5)
        pos = md["positions"]
        pool.set_kv_buffer(layer, loc, k[lid, pos], v[lid, pos], positions=pos, req_rows=md["rows"],
                           seq_lens=md["tok_seq_lens"], win_targets=md.get("win_targets"))
        q3 = q[lid, pos].view(2, HQ, D)
        cols = slice(lid * H, (lid + 1) * H)
        be_k._salient_echo_decode(q3, layer, md)
        batched = pool.echo_rows[loc, cols].clone()
        pool.echo_rows[loc, cols] = 0
        be_k._salient_echo_each(q3, layer, md)
        each = pool.echo_rows[loc, cols].float()
        assert torch.allclose(each, batched.float(), atol=1e-3, rtol=2e-3), (lid, lens)
        assert bool(batched.float().gt(0).all())
        span = sal.echo_span(SINK)
        for split in (None, 16):
            md.pop("plan", None)
            if split is not None:
                cos, sin = be_k._cos_sin(max(md["seq_lens"]), "cpu")
                md["plan"] = cpu.DecodePlan(md["kv_indptr"], md["kv_indices"], pool.tasq_config, pool.code_bytes_k, HQ,
                                            H, D, cos.squeeze(1), sin.squeeze(1), pool.exact.entry_of, split)
            plain = be_k._decode_cpu(q3, layer, md)
            out, echo = be_k._decode_cpu(q3, layer, md, echo_span=span)
            assert torch.equal(out, plain)
            assert torch.allclose(echo.half().float(), each, atol=1e-3, rtol=2e-3), (lid, lens, split, echo, each)


def test_the_tree_slots_adopt_a_recompute_s_kept_flags():
    """A request that recomputed a cached prefix into fresh slots (an entry was gone) is repointed
    to the tree's slots on insert: they take its entries where they lack one, and the kept flags
    of blocks only the recompute decided."""
    pool, r2t, be_k, be_t, cb = _setup()
    rows = r2t.alloc_rows(2)
    data = _data(seed=3)
    free = list(range(1, 600))
    first = Runner(pool, r2t, be_k, rows[0], free)
    first.forward(40, data)  # ends before block 0's horizon (41): nothing decided in the tree's slots
    again = Runner(pool, r2t, be_k, rows[1], free)
    again.forward(T, data)
    canon = r2t.req_to_token[rows[0], :40].to(torch.int64)
    fresh = r2t.req_to_token[rows[1], :40].to(torch.int64)
    assert int(pool.exact.kept[canon].sum()) == 0 and int(pool.exact.kept[fresh].sum()) > 0
    pool.exact.release_slots(canon[10:12])
    pool.adopt_entries(fresh, canon)
    assert torch.equal(pool.exact.kept[canon], pool.exact.kept[fresh])
    assert bool((pool.exact.entry_of[canon[pool.exact.kept[canon] > 0]] > 0).all())


def test_a_finished_prompt_stays_matchable_while_later_requests_fill_the_store():
    """Every new token holds an entry until its block is decided, and a non-kept one keeps it
    (LRU) after its request moved on. When later requests fill the store, eviction takes those
    interior entries (left behind by an extend) before the sink and prompt tail a warm match of a
    finished prompt needs, and the entries of kept slots last: the prompt is matched whole."""
    pool, r2t, be_k, be_t, cb = _setup(forward_tokens=64)
    st = pool.exact
    data = _data(seed=4)
    free = list(range(1, 600))
    row = r2t.alloc_rows(1)[0]
    first = Runner(pool, r2t, be_k, row, free)
    for n in (37, 50, 43):
        first.forward(n, data)
    for _ in range(2):
        first.forward(1, data, decode=True)
    prompt = r2t.req_to_token[row, :T].to(torch.int64)
    kept = st.kept[prompt] > 0
    interior = torch.zeros(T, dtype=torch.bool)
    interior[SINK: T - RECENT] = True  # out of the last prompt query's window
    interior &= ~kept
    assert bool((st.entry_of[prompt] > 0).all())  # every token still has its entry
    got = st.interior[st.entry_of[prompt]] & ~kept
    assert torch.equal(got, interior), torch.nonzero(got != interior).flatten().tolist()  # demoted by the extends only
    r2t.free_rows([row])
    for seed in (5, 6, 7):  # three more requests, one at a time, through the same store
        row = r2t.alloc_rows(1)[0]
        other = Runner(pool, r2t, be_k, row, free)
        for n in (37, 50, 43):
            other.forward(n, _data(seed=seed))
        r2t.free_rows([row])
    assert st.evictions > 0 and st.used() <= st.capacity
    assert bool((st.entry_of[prompt[interior]] == 0).any())  # the store ran full: interiors went
    assert bool((st.entry_of[prompt[~interior]] > 0).all())  # sink, tail and kept slots stayed
    assert pool.valid_prefix(prompt[:T - 1]) == T - 1  # the same prompt again: its last token recomputed
    assert pool.valid_prefix(prompt) == T  # a follow-up after the prompt


@pytest.mark.parametrize("cached", [0, 2])
def test_cached_windows_keep_a_finished_prompt_matchable_without_salient_tokens(cached):
    """Plain windows: the store holds the windows of its running rows plus ``cached`` finished
    sequences' (``SGLANG_TASQ_CACHED_WINDOWS``). With room for them, a prompt that finished before
    another request ran is matched whole; without, its windows were evicted and the match is cut
    (recomputed, never read from codes)."""
    pool, r2t, be_k, be_t, cb = _setup(budget=0, rows=1, cached_windows=cached)
    st = pool.exact
    assert st.capacity == (SINK + 2 * RECENT) + cached * (SINK + RECENT)
    free = list(range(1, 600))
    row = r2t.alloc_rows(1)[0]
    first = Runner(pool, r2t, be_k, row, free)
    for n in (37, 50, 43):
        first.forward(n, _data(seed=8))
    for _ in range(2):
        first.forward(1, _data(seed=8), decode=True)
    prompt = r2t.req_to_token[row, :T].to(torch.int64)
    assert pool.valid_prefix(prompt) == T
    r2t.free_rows([row])
    row = r2t.alloc_rows(1)[0]
    other = Runner(pool, r2t, be_k, row, free)
    for n in (37, 50, 43):
        other.forward(n, _data(seed=9), other=be_t)
    assert st.evictions > 0
    if cached:
        assert pool.valid_prefix(prompt[:T - 1]) == T - 1 and pool.valid_prefix(prompt) == T
    else:
        assert pool.valid_prefix(prompt) < SINK + RECENT


def test_a_matched_prefix_tail_is_a_branch_point_that_stays():
    """A request that matched a cached prefix restores that prefix's tail (its first writer's
    extends had demoted it) and never demotes it; only the tokens it computes itself are demoted
    as they leave its window. Later requests filling the store leave both the branch point and
    the first prompt's end matchable."""
    pool, r2t, be_k, be_t, cb = _setup(forward_tokens=64)
    st = pool.exact
    data = _data(seed=10)
    free = list(range(1, 600))
    rows = r2t.alloc_rows(2)
    first = Runner(pool, r2t, be_k, rows[0], free)
    for n in (37, 50, 43):
        first.forward(n, data)
    a = r2t.req_to_token[rows[0], :T].to(torch.int64)
    kept = st.kept[a] > 0
    tail = torch.zeros(T, dtype=torch.bool)
    tail[100 + 1 - RECENT: 100] = True  # what a query at position 100 reads exactly besides the sink
    left = tail.clone()
    left[T - RECENT:] = False  # out of the first request's last window
    assert bool(left.any()) and bool(st.interior[st.entry_of[a[left & ~kept]]].all())  # demoted by its extends
    second = Runner(pool, r2t, be_k, rows[1], free)
    r2t.req_to_token[rows[1], :100] = r2t.req_to_token[rows[0], :100]
    assert pool.valid_prefix(a[:100]) == 100
    second.S = 100
    second.forward(30, data, other=be_t)
    second.forward(20, _data(n=T + 40, seed=11))
    assert not bool(st.interior[st.entry_of[a[tail]]].any())  # restored, and not demoted again
    b = r2t.req_to_token[rows[1], 100:150].to(torch.int64)
    own = torch.arange(100, 150) < 150 - RECENT
    assert bool(st.interior[st.entry_of[b[own & (st.kept[b] == 0)]]].all())  # its own tokens: demoted
    r2t.free_rows(rows)
    for seed in (12, 13, 14):
        row = r2t.alloc_rows(1)[0]
        other = Runner(pool, r2t, be_k, row, free)
        for n in (37, 50, 43):
            other.forward(n, _data(seed=seed))
        r2t.free_rows([row])
    assert st.evictions > 0
    assert pool.valid_prefix(a[:100]) == 100 and pool.valid_prefix(a[:T - 1]) == T - 1
