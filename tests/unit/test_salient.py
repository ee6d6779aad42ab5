"""Salient tokens kept exact (sglang_tasq.salient) and the retrieval bench's harness (bench.retrieval):
selection by brute force, bits, and the decode view reading kept positions exactly."""
import pytest
import torch
from _support import tiny_decode_view_llama

from bench import attention_error as ae
from bench import retrieval as R
from bench import ruler
from sglang_tasq import salient as sal
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.cache import TaSQCache, unrotate_keys
from sglang_tasq.rope import apply_rope
from sglang_tasq.testing import random_codebooks

V = 128


def _brute_select(probs, sink, recent, spec):
    """Per head: pooled score of p = max over |p' - p| <= pool // 2 of the summed attention;
    candidates sink <= p < T - recent; best B, ties to the lower position."""
    H, T = probs.shape[0], probs.shape[-1]
    s = probs.sum((1, 2))
    out = []
    for h in range(H):
        r = spec.pool // 2
        pooled = [max(s[h, max(0, p - r): p + r + 1]) for p in range(T)]
        cand = list(range(min(sink, T), max(min(sink, T), T - recent)))
        best = sorted(cand, key=lambda p: (-float(pooled[p]), p))[: spec.budget]
        out.append(sorted(best))
    return torch.tensor(out, dtype=torch.long).view(H, -1)


@pytest.mark.parametrize("T,sink,recent,budget,pool", [(50, 4, 8, 5, 7), (50, 0, 0, 3, 1), (33, 4, 30, 9, 3),
                                                       (20, 4, 16, 4, 5), (61, 2, 5, 0, 7)])
def test_select_equals_brute_force(T, sink, recent, budget, pool):
    g = torch.Generator().manual_seed(T + budget)
    probs = torch.softmax(3 * torch.randn(3, 2, 4, T, generator=g), -1)
    probs[1, :, :, 10:14] = 0.25  # a flat run: ties resolved to the lower positions
    spec = sal.SalientSpec(budget, obs=4, pool=pool)
    got = sal.select(probs, sink, recent, spec)
    assert torch.equal(got, _brute_select(probs, sink, recent, spec))
    lo, hi = sal.candidates(T, sink, recent)
    assert got.shape == (3, max(0, min(budget, hi - lo)))
    assert bool(((got >= lo) & (got < hi)).all())


def test_select_finds_a_needle_with_its_neighbours():
    probs = torch.full((2, 3, 8, 400), 1e-4)
    probs[0, :, :, 200] = 0.9  # head 0 looks at 200, head 1 at 90
    probs[1, :, :, 90] = 0.9
    kept = sal.select(probs, 16, 64, sal.SalientSpec(7, obs=8, pool=7))
    assert kept[0].tolist() == list(range(197, 204)) and kept[1].tolist() == list(range(87, 94))
    assert sal.select(probs, 16, 64, sal.SalientSpec(1, obs=8, pool=1))[:, 0].tolist() == [200, 90]


def test_forward_reach_scores_the_tokens_after_a_peak():
    probs = torch.zeros(1, 1, 1, 40)
    probs[0, 0, 0, 10] = 1.0
    s = sal.token_scores(probs, (1, 5))[0]
    assert s.nonzero()[:, 0].tolist() == list(range(9, 16))  # one before the peak, five after
    assert sal.token_scores(probs, 5)[0].nonzero()[:, 0].tolist() == list(range(8, 13))
    kept = sal.select(probs.expand(2, 1, 1, 40), 0, 0, sal.SalientSpec(7, obs=1, after=5))
    assert kept[0].tolist() == list(range(9, 16))
    assert sal.SalientSpec(4).reach == (3, 3) and sal.SalientSpec(4, after=9).reach == (1, 9)


def test_bits_and_spec_checks():
    assert sal.side_bits(64, 1024, 64) == pytest.approx(64 / 1024 * 16.25)
    assert sal.side_bits(64, 32, 64) == pytest.approx(16.25)  # never more tokens than the prompt
    assert sal.window_bits(64, 256, 1000) == pytest.approx(5.12) and sal.window_bits(0, 0, 10) == 0
    for bad in (dict(budget=-1), dict(budget=4, pool=4), dict(budget=4, obs=0), dict(budget=4, after=-1)):
        with pytest.raises(ValueError):
            sal.SalientSpec(**bad)
    m = sal.kept_mask(torch.tensor([[1, 3], [0, 2]]), 5)
    assert m.tolist() == [[False, True, False, True, False], [True, False, True, False, False]]


@pytest.fixture(scope="module")
def model():
    return tiny_decode_view_llama(V)


@pytest.fixture(scope="module")
def method():
    cb = random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=5)
    return TaSQCache(cb).method


def _run(model, method, ids, sink, recent, salient=None, select_at=None, steps=6, after_prompt=None):
    """Logits of the prompt's last position and of ``steps`` greedy decode steps, and the probe."""
    cache = ae.ProbeCache(method)
    probe = ae.Probe(cache, sink, recent, salient=salient, select_at=select_at or len(ids))
    out = []
    with torch.no_grad(), ae.active(probe):
        logits = model(ids[None], past_key_values=cache).logits[0, -1]
        if after_prompt:
            after_prompt(probe)
        for _ in range(steps):
            out.append(logits)
            logits = model(logits.argmax().view(1, 1), past_key_values=cache).logits[0, 0]
    return torch.stack(out), probe


def test_kept_positions_are_read_exactly(model, method):
    """Keeping every candidate exact == widening the sink over every candidate after the prompt
    (the prompt itself attended under the windows in both; the recent window's tokens are not
    candidates and move to codes as they leave it); budget 0 == no salient tokens."""
    ids = torch.randint(0, V, (90,), generator=torch.Generator().manual_seed(1))
    plain, _ = _run(model, method, ids, 4, 8)
    none, p0 = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(0))
    assert torch.equal(plain, none) and all(k.numel() == 0 for k in p0.kept.values())
    every, p = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(1000, obs=8))
    assert sorted(p.kept) == [0, 1] and all(k.shape == (2, 90 - 8 - 4) for k in p.kept.values())

    def widen(probe):
        probe.sink = 90 - 8
    wide, _ = _run(model, method, ids, 4, 8, after_prompt=widen)
    assert torch.allclose(every, wide, atol=1e-5)
    assert torch.allclose(every[0], plain[0])  # selection changes nothing before it
    assert not torch.allclose(every[1:], plain[1:], atol=1e-3)
    part, pp = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(10, obs=8))
    assert all(k.shape == (2, 10) for k in pp.kept.values())
    assert not torch.allclose(part[1:], plain[1:], atol=1e-4)


def test_shared_set_is_the_best_of_all_layers_and_heads(model, method):
    """``shared``: one set of positions, kept in every layer and head, the top of the pooled
    scores summed over layers and heads (select_shared against a brute-force sum)."""
    ids = torch.randint(0, V, (70,), generator=torch.Generator().manual_seed(3))
    spec = sal.SalientSpec(6, obs=5, pool=3, shared=True)
    plain, _ = _run(model, method, ids, 4, 8)
    got, probe = _run(model, method, ids, 4, 8, salient=spec, steps=3)
    per_head, _ = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(6, obs=5, pool=3), steps=3)
    assert sorted(probe.kept) == [0, 1] and torch.equal(probe.kept[0], probe.kept[1])
    assert probe.kept[0].shape == (2, 6) and torch.equal(probe.kept[0][0], probe.kept[0][1])
    total = sum(probe.scores[layer][h] for layer in (0, 1) for h in (0, 1))
    want = sorted(sorted(range(4, 62), key=lambda p: (-float(total[p]), p))[:6])
    assert probe.kept[0][0].tolist() == want
    assert torch.equal(got[0], plain[0]) and not torch.allclose(got[1:], plain[1:3], atol=1e-4)
    assert not torch.allclose(got[1:], per_head[1:], atol=1e-6)


def test_selection_uses_the_observation_queries_over_the_keys_as_served(model, method):
    """The kept positions are sal.select of the last ``obs`` prompt queries' probabilities, the
    same scores the decode view attends with (codes outside the windows)."""
    ids = torch.randint(0, V, (70,), generator=torch.Generator().manual_seed(2))
    spec = sal.SalientSpec(6, obs=5, pool=3)
    _, probe = _run(model, method, ids, 4, 8, salient=spec, steps=1)
    captured = {}
    orig = ae._mix

    def spy(q, kq, ke, vq, ve, a, b, sink, recent):
        S, out = orig(q, kq, ke, vq, ve, a, b, sink, recent)
        if (a, b) == (65, 70):
            captured.setdefault(len(captured), torch.softmax(S, -1))
        return S, out
    ae._mix = spy
    try:
        _run(model, method, ids, 4, 8, salient=spec, steps=1)
    finally:
        ae._mix = orig
    assert len(captured) == 2  # one per layer
    for layer in (0, 1):
        assert torch.equal(probe.kept[layer], sal.select(captured[layer], 4, 8, spec))


def test_echo_scores_read_the_head_without_its_first_token():
    """Each query's attention to positions [1, sink), summed over the query heads of its KV head."""
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(2, 3, 5, 40, generator=g), -1)
    got = sal.echo_scores(probs, 6)
    assert got.shape == (2, 5)
    for h in range(2):
        for t in range(5):
            want = sum(float(probs[h, q, t, j]) for q in range(3) for j in range(1, 6))
            assert float(got[h, t]) == pytest.approx(want, rel=1e-6)
    assert sal.echo_span(64) == (1, 64) and sal.echo_span(0) == (0, 0)
    assert sal.echo_scores(probs, 0).abs().max() == 0  # no head, no echo


def test_above_local_median_equals_brute_force():
    g = torch.Generator().manual_seed(5)
    s = torch.rand(2, 30, generator=g)
    got = sal.above_local_median(s, 7)
    for h in range(2):
        for t in range(30):
            win = [float(s[h, min(29, max(0, j))]) for j in range(t - 3, t + 4)]  # edges replicated
            assert float(got[h, t]) == pytest.approx(float(s[h, t]) - sorted(win)[3], abs=1e-7)
    for bad in (0, 8):
        with pytest.raises(ValueError, match="odd"):
            sal.above_local_median(s, bad)


def test_echo_peak_wins_over_the_drift_near_the_head():
    """A stretch near the head looks back at it more than a needle's key word far away does; the
    running median takes the drift out, and the forward reach keeps what follows the peak."""
    T = 400
    s = torch.linspace(0.6, 0.05, T)[None]  # attention to the head falls with distance
    s[0, 300] += 0.3  # the key word, far from the head
    raw = sal.pooled(s, (1, 12))
    assert sal.top_positions(raw, 64, 16, 14)[0].tolist() == list(range(64, 78))  # drift wins
    peak = sal.pooled(sal.above_local_median(s), (1, 12))
    assert sal.top_positions(peak, 64, 16, 14)[0].tolist() == list(range(299, 313))


def test_echo_selection_uses_every_prompt_query_over_the_keys_as_served(model, method):
    """echo: the kept positions are the top of each prompt query's served attention to [1, sink),
    less its running median, pooled forward; computed in the prompt's forward, no extra pass."""
    ids = torch.randint(0, V, (90,), generator=torch.Generator().manual_seed(6))
    spec = sal.SalientSpec(6, after=4, rule="echo")
    captured = {}
    orig = ae._mix

    def spy(q, kq, ke, vq, ve, a, b, sink, recent):
        S, out = orig(q, kq, ke, vq, ve, a, b, sink, recent)
        if b - a > 1 and b <= 90:  # the prompt's forward, one chunk per layer here
            captured[len(captured)] = torch.softmax(S, -1)
        return S, out
    ae._mix = spy
    try:
        _, probe = _run(model, method, ids, 4, 8, salient=spec, steps=1)
    finally:
        ae._mix = orig
    assert len(captured) == 2  # no observation pass: one prompt chunk per layer
    for layer in (0, 1):
        want = sal.pooled(sal.above_local_median(sal.echo_scores(captured[layer], 4)), (1, 4))
        assert torch.equal(probe.scores[layer], want)
        assert torch.equal(probe.kept[layer], sal.top_positions(want, 4, 8, 6))
    obs, p2 = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(6, after=4), steps=1)
    assert not torch.equal(p2.kept[0], probe.kept[0])


def test_window_echo_reads_the_exact_keys_only():
    """Each query's softmax over the pairs the window rule reads exactly, summed over [1, sink)
    and the query heads of its KV head (brute force); the codes never enter it."""
    g = torch.Generator().manual_seed(8)
    cols = torch.tensor([0, 1, 2, 3, 7, 8, 9, 10, 11])
    S = torch.randn(2, 3, 4, cols.numel(), generator=g)
    t = torch.arange(8, 12)
    exact = torch.tensor([[c < 4 or (int(i) - 3 <= c <= int(i)) for c in cols.tolist()] for i in t])
    got = sal.window_echo(S, exact, cols, 4)
    for h in range(2):
        for r in range(4):
            tot = 0.0
            for q in range(3):
                z = [float(S[h, q, r, j].exp()) if exact[r, j] else 0.0 for j in range(cols.numel())]
                tot += sum(z[j] for j in range(cols.numel()) if 1 <= cols[j] < 4) / sum(z)
            assert float(got[h, r]) == pytest.approx(tot, rel=1e-5)


@pytest.mark.parametrize("P,S,block", [(0, 70, 16), (23, 61, 8), (0, 9, 4)])
def test_query_echo_in_blocks_equals_window_echo_over_every_column(P, S, block):
    """query_echo runs its queries in blocks, each against the columns some query of the block
    reads exactly (the sink, its recent windows): the same as window_echo of all queries over
    every column the extend passes (a one-chunk prompt: all of them)."""
    from sglang_tasq.windows import query_window, window_columns

    g = torch.Generator().manual_seed(9)
    sink, recent = 4, 10
    cols = window_columns(P, S, sink, recent)
    q, k = torch.randn(S - P, 6, 8, generator=g), torch.randn(cols.numel(), 2, 8, generator=g)
    qpos = torch.arange(P, S)
    got = sal.query_echo(q, k, qpos, cols, sink, recent, 0.5, block=block)
    qh = q.view(S - P, 2, 3, 8).permute(1, 2, 0, 3)  # [H, G, c, d]
    scores = torch.einsum("hgcd,mhd->hgcm", qh, k) * 0.5
    exact = query_window(qpos, cols, sink, recent) & (cols[None] <= qpos[:, None])
    want = sal.window_echo(scores, exact, cols, sink).T
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def _brute_blocks(rows, upto, sink, spec):
    """Block k kept: its spec.budget best positions >= sink by the sum over rows of max over
    [p - after, p + before] of (s - running median of the 65 around it, edges replicated), read
    from rows[:, :upto] only."""
    r, (before, after) = sal.ECHO_WINDOW // 2, spec.reach

    def d(s, q):
        win = sorted(s[min(upto - 1, max(0, j))] for j in range(q - r, q + r + 1))
        return s[q] - win[r]
    out = []
    for k in range(sal.decided_blocks(upto, spec)):
        cand = range(max(k * spec.block, sink), (k + 1) * spec.block)
        c = {p: 0.0 for p in cand}
        for row in rows:
            s = [float(x) for x in row[:upto]]
            for p in cand:
                c[p] += max(d(s, q) for q in range(max(0, p - after), min(upto, p + before + 1)))
        out += sorted(sorted(cand, key=lambda p: (-c[p], p))[: spec.budget])
    return out


def test_blocks_are_decided_from_their_prefix_alone():
    """decide_blocks == brute force, and a block's kept positions do not change as more tokens
    are scored (the prefix decides them: shareable through a radix cache, chunking-invariant)."""
    spec = sal.SalientSpec(5, shared=True, after=12, rule="echo", block=40)
    assert spec.lookahead == 33 and sal.block_horizon(0, spec) == 73
    assert [sal.decided_blocks(u, spec) for u in (72, 73, 112, 113)] == [0, 1, 1, 2]
    g = torch.Generator().manual_seed(9)
    rows = torch.rand(3, 400, generator=g, dtype=torch.float64)
    rows[1, 150:152] += 3.0
    full = sal.decide_blocks(rows, 400, 0, 6, spec)
    assert full.tolist() == _brute_blocks(rows, 400, 6, spec)
    assert full.numel() == 5 * sal.decided_blocks(400, spec) and int(full.min()) >= 6
    kept = full.tolist()  # the peak (one row) and what follows it, in its block and the next
    assert all(149 <= p < 160 for p in kept if 120 <= p < 160) and len({160, 161, 162, 163} & set(kept)) == 4
    assert sal.decide_blocks(rows[0], 400, 0, 6, spec).tolist() == _brute_blocks(rows[:1], 400, 6, spec)
    for upto in (73, 150, 193, 230, 331):
        part = sal.decide_blocks(rows, upto, 0, 6, spec)
        assert torch.equal(part, full[: part.numel()])
        rest = sal.decide_blocks(rows, 400, sal.decided_blocks(upto, spec), 6, spec)
        assert torch.equal(torch.cat([part, rest]), full)
    with pytest.raises(ValueError, match="recent window >= 73"):
        spec.check_windows(4, 64)
    for bad in ({"rule": "obs"}, {"shared": False}, {"budget": 41}):
        with pytest.raises(ValueError, match="streaming"):
            sal.SalientSpec(**{**dict(budget=5, shared=True, rule="echo", block=40), **bad})
    with pytest.raises(ValueError, match="deciding layer"):
        sal.SalientSpec(5, shared=True, rule="echo", layer=2)


def test_streaming_selection_is_the_same_chunked_or_whole(model, method):
    """The decode view's streaming selection: every forward's queries add their window echo (all
    layers, heads) to one score per token, blocks are decided between forwards; the prompt read in
    one forward or in uneven pieces keeps the same tokens and gives the same logits, the kept
    tokens are read exactly (the logits move), and the decisions are decide_blocks of the scores."""
    spec = sal.SalientSpec(3, shared=True, after=4, rule="echo", block=16, layer=1)
    ids = torch.randint(0, V, (160,), generator=torch.Generator().manual_seed(10))
    sink, recent = 4, 16 + spec.lookahead

    def run(pieces, salient=spec):
        cache = ae.ProbeCache(method)
        probe = ae.Probe(cache, sink, recent, salient=salient, select_at=len(ids))
        out, at = [], 0
        with torch.no_grad(), ae.active(probe):
            for n in pieces:
                logits = model(ids[None, at: at + n], past_key_values=cache).logits[0]
                out.append(logits)
                at += n
            for _ in range(3):
                logits = model(out[-1][-1].argmax().view(1, 1), past_key_values=cache).logits[0]
                out.append(logits)
        return torch.cat(out), probe

    whole, p1 = run([160])
    pieces, p2 = run([37, 1, 70, 52])
    plain, _ = run([160], salient=None)
    assert torch.allclose(whole, pieces, atol=1e-4)
    assert torch.equal(p1.kept["all"], p2.kept["all"])
    kept = p1.kept["all"]
    assert kept.numel() == 3 * sal.decided_blocks(163, spec) and p1.decided == sal.decided_blocks(163, spec)
    assert torch.equal(kept, sal.decide_blocks(ae.stream_rows(p1, 163), 163, 0, sink, spec))
    assert torch.allclose(whole[:sal.block_horizon(0, spec)], plain[:sal.block_horizon(0, spec)], atol=1e-6)
    assert not torch.allclose(whole[100:], plain[100:], atol=1e-4)  # past a horizon: kept tokens read exactly
    rows = ae.stream_rows(p1, p1.stream[0].shape[1])
    assert sorted(p1.stream) == [0, 1] and rows.shape[0] == 2 * 2  # layers 0..1 x 2 KV heads
    assert rows[:, 0].eq(0).all() and rows[:, 1:163].gt(0).all() and rows[:, 163:].eq(0).all()  # token 0: no head yet


def test_top_union_splits_the_budget_between_two_rules():
    first = torch.zeros(1, 40)
    first[0, 10:20] = torch.arange(10, 0, -1).float()  # best by the first rule: 10, 11, 12, ...
    second = torch.zeros(1, 40)
    second[0, 10:13] = 9.0  # the second rule's best are already kept by the first
    second[0, 30:33] = torch.tensor([3.0, 2.0, 1.0])
    got = sal.top_union(first, second, 4, 4, 7)[0].tolist()
    assert got == [10, 11, 12, 13, 30, 31, 32]  # 4 by the first, 3 by the second, no position twice
    assert torch.equal(sal.top_union(first, None, 4, 4, 7), sal.top_positions(first, 4, 4, 7))
    small = sal.top_union(first, second, 4, 30, 9)  # only 6 candidates: each kept once
    assert small[0].tolist() == [4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="rule"):
        sal.SalientSpec(4, rule="nosuch")


def test_both_rules_keep_half_each(model, method):
    ids = torch.randint(0, V, (90,), generator=torch.Generator().manual_seed(7))
    _, obs = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(6, after=4), steps=1)
    _, echo = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(6, after=4, rule="echo"), steps=1)
    _, both = _run(model, method, ids, 4, 8, salient=sal.SalientSpec(6, after=4, rule="both"), steps=1)
    for layer in (0, 1):
        assert torch.equal(both.scores[layer], obs.scores[layer]) and torch.equal(both.echo[layer], echo.scores[layer])
        assert torch.equal(both.kept[layer], sal.top_union(obs.scores[layer], echo.scores[layer], 4, 8, 6))
        for h in range(2):
            assert set(sal.top_positions(obs.scores[layer], 4, 8, 3)[h].tolist()) <= set(both.kept[layer][h].tolist())
    spec = sal.SalientSpec(6, after=4, rule="both", shared=True)
    _, sh = _run(model, method, ids, 4, 8, salient=spec, steps=2)
    want = sal.select_shared([sh.scores[i] for i in (0, 1)], 4, 8, spec, [sh.echo[i] for i in (0, 1)])
    assert torch.equal(sh.kept[0][0], want) and want.shape == (6,)


class _Tok:
    """Characters as tokens, with offsets (what question_split reads)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = {"input_ids": [ord(c) % V for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_question_later_without_salient_equals_one_forward(model, method):
    sample = {"input": "some haystack text that goes on and on for the tiny model\nWhat is the key?",
              "prompt": "<u>some haystack text that goes on and on for the tiny model\nWhat is the key?<a> The key is"}
    split = R.question_split(_Tok(), sample)
    assert sample["prompt"][split:].startswith("What is the key?")
    one = ruler.greedy(model, _Tok(), sample["prompt"], method, 4, 8, max_new=8)
    two = ruler.greedy(model, _Tok(), sample["prompt"], method, 4, 8, max_new=8, split=split)
    assert one == two
    sel = ruler.greedy(model, _Tok(), sample["prompt"], method, 4, 8, max_new=8, split=split,
                       salient=sal.SalientSpec(1000, obs=4))
    assert len(sel) == 8
    with pytest.raises(ValueError, match="split"):
        ruler.greedy(model, _Tok(), sample["prompt"], method, 4, 8, max_new=1, split=0)
    with pytest.raises(ValueError, match="decode view"):
        ruler.greedy(model, _Tok(), sample["prompt"], method, 4, 8, max_new=1, view="serving",
                     salient=sal.SalientSpec(4))


def test_points_parse_and_bits():
    p = R.Point.parse("tasq:64+256:s32:later")
    assert (p.method, p.sink, p.recent, p.budget, p.later, p.shared) == ("tasq", 64, 256, 32, True, False)
    q = R.Point.parse("tasq:16+64:S8")
    assert q.shared and q.salient() == sal.SalientSpec(8, shared=True) and q.name == "tasq:16+64:S8"
    assert q.slug != R.Point.parse("tasq:16+64:s8").slug
    a = R.Point.parse("tasq:64+256:S64a12:later")
    assert a.salient() == sal.SalientSpec(64, shared=True, after=12) and a.name == "tasq:64+256:S64a12:later"
    assert p.name == "tasq:64+256:s32:later" and R.Point.parse(p.name) == p
    assert R.Point.parse("tasq").name == "tasq:64+256" and R.Point.parse("tasq@g4k64:none").name == "tasq@g4k64:none"
    assert R.Point.parse("bf16:16+64").name == "bf16"
    f = R.Point.parse("tasq:64+256:S64a12:first")
    assert f.first and not f.later and f.question == "first" and f.name == "tasq:64+256:S64a12:first"
    assert R.Point.parse("bf16:first").name == "bf16:first" and R.Point.parse("tasq").question == "last"
    assert f.slug != a.slug and R.Point.parse(f.name) == f
    e = R.Point.parse("tasq:64+256:S128a12e:first")
    assert e.salient() == sal.SalientSpec(128, shared=True, after=12, rule="echo") and e.first
    assert e.name == "tasq:64+256:S128a12e:first" and R.Point.parse(e.name) == e and e.slug != f.slug
    assert R.Point.parse("tasq:s8e").name == "tasq:64+256:s8e"
    b = R.Point.parse("tasq:64+256:S128a12b")
    assert b.salient().rule == "both" and b.name == "tasq:64+256:S128a12b" and b.slug != e.slug
    st = R.Point.parse("tasq:64+256:S16/128L12a12e:first")
    assert st.salient() == sal.SalientSpec(16, shared=True, after=12, rule="echo", block=128, layer=12)
    assert st.name == "tasq:64+256:S16/128L12a12e:first" and R.Point.parse(st.name) == st and "/" not in st.slug
    assert R.Point.parse("tasq:S16/128a12e").salient().layer == 0
    want = 1.2915 + 5.12 + 16 / 128 * 16.25  # charged as 16 of every 128 tokens
    assert R.bits_all_in(R.Point.parse("tasq:64+256:S16/128a12e"), (1.333, 1.25), 1000, 64) == pytest.approx(want, abs=1e-3)
    for bad in ("tasq:64", "tasq:s", "nosuch:64+256", "tasq:64+256:later:s3", "tasq:64+256:later:first",
                "tasq:first:s3", "tasq:64+256:e", "tasq:64+256:S8ea2", "tasq:64+256:S16/128a12",
                "tasq:64+256:s16/128a12e", "tasq:16+64:S16/128a12e", "tasq:64+256:S16L3a12e"):
        with pytest.raises(ValueError):
            R.Point.parse(bad)
    assert R.bits_all_in(R.Point.parse("bf16"), (16, 16), 1000, 64) == 16.0
    assert R.bits_all_in(R.Point.parse("tasq:none"), (1.333, 1.25), 1000, 64) == pytest.approx(1.2915, abs=1e-3)
    want = 1.2915 + 5.12 + 32 / 1000 * 16.25
    assert R.bits_all_in(R.Point.parse("tasq:64+256:s32"), (1.333, 1.25), 1000, 64) == pytest.approx(want, abs=1e-3)
    x8 = R.Point.parse("tasq:64+256:S16/128L12a12e:x8:first")
    assert x8.side == "fp8" and x8.first and x8.name == "tasq:64+256:S16/128L12a12e:x8:first"
    assert R.Point.parse(x8.name) == x8 and x8.slug != st.slug and R.Point.parse("tasq").side == "bf16"
    want = 1.2915 + 320 / 1000 * 8.25 + 16 / 128 * 8.5  # fp8 copies with an fp16 scale per (token, head)
    assert R.bits_all_in(R.Point.parse("tasq:64+256:S16/128a12e:x8"), (1.333, 1.25), 1000, 64) == pytest.approx(want, abs=1e-3)
    r2 = R.Point.parse("tasq:64+256:S36/192L17a12e:r2:first")
    assert r2.side == "res2" and R.Point.parse(r2.name) == r2 and r2.slug != R.Point.parse(r2.name.replace("r2", "r4")).slug
    want = 1.2915 + 320 / 1000 * 2.25 + 36 / 192 * 2.5  # codes + 2-bit residuals, positions
    assert R.bits_all_in(R.Point.parse("tasq:64+256:S36/192a12e:r2"), (1.333, 1.25), 1000, 64) == pytest.approx(want, abs=1e-3)
    with pytest.raises(ValueError):
        R.Point.parse("tasq:64+256:x8:s3")


def test_fp8_side_copies():
    """fp8 rows: e4m3 with an fp16 absmax scale per row (relative error <= 2^-4 of the row's
    absmax); the decode view's fp8 side buffer moves the logits a little, not far."""
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    y = sal.fp8_rows(x)
    err = (y - x).abs().amax(-1) / x.abs().amax(-1)
    assert float(err.max()) <= 2 ** -4 and float(err.mean()) > 0
    assert torch.equal(sal.fp8_rows(torch.zeros(2, 8)), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="side format"):
        sal.copy_bits("int4", 64)


def test_res4_side_copies():
    """res4 rows: the codes' reading plus the residual rounded to a multiple of absmax / 7 per row
    (error <= half a step), packed two nibbles a byte (channel 2i low); 4.25 bits per element."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    coded = x + 0.3 * x.abs().mean() * torch.randn(50, 3, 64, generator=g)
    nib, scale = sal.res4_encode(x, coded)
    assert nib.shape == (50, 3, 32) and nib.dtype == torch.uint8 and scale.dtype == torch.float16
    y = sal.res4_decode(nib, scale, coded)
    assert float(((y - x).abs() - 0.5 * scale.float()[..., None] * (1 + 2 ** -8)).max()) <= 1e-5
    q = (((x - coded) / scale.float()[..., None]).round().clamp(-7, 7) + 8).to(torch.uint8)  # the nibbles, by hand
    assert torch.equal(nib & 15, q[..., 0::2]) and torch.equal(nib >> 4, q[..., 1::2])
    assert torch.equal(sal.res4_rows(coded, coded), coded)  # nothing missed: the codes' reading
    assert sal.copy_bits("res4", 64) == 4.25
    x8 = sal.fp8_rows(x)
    assert float((y - x).norm()) < float((coded - x).norm()) / 8 and float((x8 - x).norm()) < float((coded - x).norm())



def test_res2_side_copies():
    """res2 rows: the codes' reading plus the residual as the nearest of four Lloyd-Max levels
    times the row's RMS, four 2-bit indices a byte (channel 4i + j in bits 2j..2j+1); 2.25 bits
    per element; nearer x than the codes, farther than res4; not a served format."""
    from sglang_tasq.config import EXACT_FORMATS

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    coded = x + 0.3 * x.abs().mean() * torch.randn(50, 3, 64, generator=g)
    crumbs, scale = sal.res2_encode(x, coded)
    assert crumbs.shape == (50, 3, 16) and crumbs.dtype == torch.uint8 and scale.dtype == torch.float16
    r = (x - coded) / scale.float()[..., None]
    idx = (r[..., None] - sal.RES2_LEVELS).abs().argmin(-1)  # the nearest level, by hand
    by_hand = sum(idx[..., j::4] << (2 * j) for j in range(4)).to(torch.uint8)
    assert torch.equal(crumbs, by_hand)
    y = sal.res2_decode(crumbs, scale, coded)
    assert torch.allclose(y, coded + sal.RES2_LEVELS[idx] * scale.float()[..., None])
    assert torch.equal(sal.residual_rows("res2", x, coded), sal.res2_rows(x, coded))
    assert sal.copy_bits("res2", 64) == 2.25 and "res2" not in EXACT_FORMATS
    e2, e4, e0 = ((t - x).norm() for t in (y, sal.res4_rows(x, coded), coded))
    assert float(e4) < float(e2) < float(e0) / 2
    with pytest.raises(ValueError, match="residual format"):
        sal.residual_rows("fp8", x, coded)

def test_summary_pairs_points_over_the_same_samples():
    def item(name, scores):
        preds = [{"task": t, "index": i, "length": 1000, "gold": ["x"], "pred": "x" if s else "y"}
                 for (t, i), s in scores.items()]
        return {"point": name, "length": 1024, "avg": 100.0 * sum(scores.values()) / len(scores),
                "mean_length": 1000.0, "tasks": {}, "preds": preds}
    keys = [(t, i) for t in ("a", "b") for i in range(4)]
    items = {("bf16", 1024): item("bf16", dict.fromkeys(keys, 1)),
             ("tasq:64+256", 1024): item("tasq:64+256", {k: k[1] % 2 for k in keys}),
             ("tasq:64+256:s8", 1024): item("tasq:64+256:s8", {k: int(k[1] != 3) for k in keys})}
    rows, md = R.summarize(items, {"bf16": (16, 16), "tasq": (1.333, 1.25)}, 64, "tasq:64+256")
    by = {r["point"]: r for r in rows}
    assert by["tasq:64+256"]["niah"]["mean"] == 50 and by["tasq:64+256"]["share_of_bf16"] == 0.5
    assert by["tasq:64+256:s8"]["vs_ref"]["mean"] == pytest.approx(25.0)
    assert by["tasq:64+256:s8"]["vs_bf16"]["mean"] == pytest.approx(-25.0)
    assert "vs_ref" not in by["tasq:64+256"] and "| tasq:64+256:s8 |" in md
    # question-first points pair with bf16:first and the reference's first point, never across orders
    items[("bf16:first", 1024)] = item("bf16:first", {k: int(k[0] == "a") for k in keys})
    items[("tasq:64+256:first", 1024)] = item("tasq:64+256:first", dict.fromkeys(keys, 0))
    items[("tasq:64+256:s8:first", 1024)] = item("tasq:64+256:s8:first", {k: int(k[1] == 0) for k in keys})
    by = {r["point"]: r for r in R.summarize(items, {"bf16": (16, 16), "tasq": (1.333, 1.25)}, 64, "tasq:64+256")[0]}
    assert by["tasq:64+256:s8:first"]["share_of_bf16"] == 0.5  # 25 of bf16:first's 50, not of bf16's 100
    assert by["tasq:64+256:s8:first"]["vs_ref"]["mean"] == pytest.approx(25.0)
    assert by["tasq:64+256:s8:first"]["vs_bf16"]["mean"] == pytest.approx(-25.0)
    assert "vs_bf16" not in by["bf16:first"] and "vs_ref" not in by["tasq:64+256:first"]
    assert by["tasq:64+256:s8"]["share_of_bf16"] == 0.75  # the question-last rows are unchanged
    assert by["tasq:64+256:s8:first"]["vs_last"]["mean"] == pytest.approx(-50.0)  # 0.25 - 0.75, sample by sample
    assert by["bf16:first"]["vs_last"]["mean"] == pytest.approx(-50.0) and "vs_last" not in by["tasq:64+256:s8"]


def test_cli_refuses_bad_points_before_loading_anything(capsys):
    assert R.main(["--points", "tasq:64"]) == 2
    assert "METHOD[:none|SINK+RECENT]" in capsys.readouterr().err
    assert R.main(["--points", "tasq", "--tasks", "niah_nosuch"]) == 2
    assert "niah_nosuch" in capsys.readouterr().err


def test_run_folder_refuses_a_recalibrated_artifact(tmp_path):
    R.check_artifacts(tmp_path, {"tasq": "a" * 64})
    R.check_artifacts(tmp_path, {"tasq": "a" * 64, "tasq_g4k256": "b" * 64})  # a new name joins
    with pytest.raises(ValueError, match="other artifacts"):
        R.check_artifacts(tmp_path, {"tasq": "c" * 64})
    assert R.run_name("m", "default", 8, ["t"], None) != R.run_name("m", "default", 8, ["t"], 64)
    # a float32-model run gets its own folder; bf16 keeps the folder names it had
    assert R.run_name("m", "default", 8, ["t"], None, "float32") != R.run_name("m", "default", 8, ["t"], None)
    assert R.run_name("m", "default", 8, ["t"], None, "bfloat16") == R.run_name("m", "default", 8, ["t"], None)


def test_decode_view_fp8_side_buffer(model, method):
    """ProbeCache(side="fp8") holds values as fp8 rows and keys as fp8 rows of their pre-RoPE
    form, re-rotated; with every token in the windows the logits move a little from bf16 copies."""
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(3))

    def run(side):
        cache = ae.ProbeCache(method, side)
        with torch.no_grad(), ae.active(ae.Probe(cache, 1000, 0)):
            logits = model(ids[None], past_key_values=cache).logits[0]
        return logits, cache

    exact, c16 = run("bf16")
    held, c8 = run("fp8")
    k16, v16 = c16.exact_kv(0)  # layer 0: the same inputs either way
    k8, v8 = c8.exact_kv(0)
    assert torch.equal(v8, sal.fp8_rows(v16))
    keys = method.keys
    pre = unrotate_keys(k16[0].transpose(0, 1), torch.arange(40), keys.inv_freq, keys.attention_scaling)
    want = apply_rope(sal.fp8_rows(pre), torch.arange(40), keys.inv_freq, keys.attention_scaling)
    assert torch.allclose(k8[0].transpose(0, 1), want, atol=1e-5)
    assert not torch.equal(held, exact) and torch.allclose(held, exact, atol=0.05 * float(exact.abs().max()))
    with pytest.raises(ValueError, match="side format"):
        ae.ProbeCache(method, "int4")


def test_decode_view_res4_side_buffer(model, method):
    """ProbeCache(side="res4") holds each copy as the token's own codes (the cache's quantizer)
    plus a 4-bit residual, keys in their pre-RoPE form: nearer the exact copies than the codes."""
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(3))
    cache16, cache4 = ae.ProbeCache(method, "bf16"), ae.ProbeCache(method, "res4")
    with torch.no_grad():
        for c in (cache16, cache4):
            with ae.active(ae.Probe(c, 1000, 0)):
                model(ids[None], past_key_values=c)
    k16, v16 = cache16.exact_kv(0)
    k4, v4 = cache4.exact_kv(0)
    coded_v = method.values.decode(method.values.encode(v16[0].transpose(0, 1).float(), 0, {}), 0, {})
    assert torch.allclose(v4[0].transpose(0, 1).float(), sal.res4_rows(v16[0].transpose(0, 1).float(), coded_v), atol=1e-2)
    keys = method.keys
    pre = unrotate_keys(k16[0].transpose(0, 1).float(), torch.arange(40), keys.inv_freq, keys.attention_scaling)
    coded_k = keys.decode(keys.encode(pre, 0, {}), 0, {})
    want = apply_rope(sal.res4_rows(pre, coded_k), torch.arange(40), keys.inv_freq, keys.attention_scaling)
    assert torch.allclose(k4[0].transpose(0, 1).float(), want, atol=2e-2)
    for got, exact, coded in ((k4, k16, apply_rope(coded_k, torch.arange(40), keys.inv_freq, keys.attention_scaling)),
                              (v4, v16, coded_v)):
        e = exact[0].transpose(0, 1).float()
        assert float((got[0].transpose(0, 1).float() - e).norm()) < float((coded - e).norm()) / 4
    from sglang_tasq.hf.baselines import baseline
    from sglang_tasq.hf.cache import held_copies

    x = torch.randn(1, 2, 32, 16)
    assert torch.equal(held_copies(x, 0, "res4", coder=baseline("bf16").values), x)  # an exact side: as it is
    for coder in (None, baseline("kivi2").keys):  # no codes, codes in blocks
        with pytest.raises(ValueError, match="completes each token's own codes"):
            held_copies(x, 0, "res4", coder=coder)
