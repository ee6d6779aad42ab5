"""The full-precision window rule and the slot-keyed exact store (sglang_tasq.windows), against
brute-force definitions and a plain-Python model of the store; pure torch, no SGLang."""
import random

import pytest
import torch

from sglang_tasq.windows import ExactStore, ExactStoreFull, exact_prefix_limit, in_window, query_window


# ---- the rule -------------------------------------------------------------------------------
def _brute_prefix_limit(present, sink, recent):
    """Largest P' <= P whose first recomputed query (at position P') finds every entry it reads
    in the prefix: j < min(sink, P') and max(0, P' + 1 - recent) <= j < P'."""
    for Pp in range(len(present), -1, -1):
        need = set(range(min(sink, Pp))) | set(range(max(0, Pp + 1 - recent), Pp))
        if all(present[j] for j in need):
            return Pp
    raise AssertionError("P' = 0 is always usable")


@pytest.mark.parametrize("sink,recent", [(0, 0), (0, 1), (0, 3), (1, 0), (2, 0), (1, 1), (2, 3), (4, 2), (3, 7)])
def test_exact_prefix_limit_matches_brute_force(sink, recent):
    rng = random.Random(sink * 31 + recent)
    for P in range(41):
        for trial in range(12):
            density = (0.0, 0.3, 0.7, 0.9, 1.0)[trial % 5]
            present = [rng.random() < density for _ in range(P)]
            if trial == 11 and P:  # one hole at a random position, everything else present
                present = [True] * P
                present[rng.randrange(P)] = False
            got = exact_prefix_limit(torch.tensor(present, dtype=torch.bool), sink, recent)
            assert got == _brute_prefix_limit(present, sink, recent), (P, sink, recent, present)
            assert isinstance(got, int)


def test_exact_prefix_limit_edges():
    assert exact_prefix_limit(torch.zeros(0, dtype=torch.bool), 2, 3) == 0
    assert exact_prefix_limit(torch.ones(10, dtype=torch.bool), 2, 3) == 10
    assert exact_prefix_limit(torch.zeros(10, dtype=torch.bool), 0, 0) == 10  # no windows: all of it
    # a missing sink entry cuts the match right there; a missing tail entry moves it back
    assert exact_prefix_limit(torch.tensor([1, 0, 1, 1, 1, 1]).bool(), 2, 3) == 1
    assert exact_prefix_limit(torch.tensor([1, 1, 1, 1, 0, 1]).bool(), 2, 3) == 4
    # int (0/1) presence works like bool
    assert exact_prefix_limit(torch.tensor([1, 1, 0, 1, 0, 1]), 2, 3) == 2


@pytest.mark.parametrize("sink,recent", [(0, 0), (2, 0), (0, 3), (2, 3), (5, 1)])
def test_in_window_and_query_window_rule(sink, recent):
    S = 12
    pos = torch.arange(S)
    for n in range(S + 1):
        want = torch.tensor([p < sink or p >= n - recent for p in range(S)])
        assert torch.equal(in_window(pos, n, sink, recent), want)
    # per-token kv lengths
    lens = torch.randint(1, 20, (S,), generator=torch.Generator().manual_seed(1))
    want = torch.tensor([p < sink or p >= int(n) - recent for p, n in zip(range(S), lens)])
    assert torch.equal(in_window(pos, lens, sink, recent), want)
    # query i reads key j exactly iff j < sink or j >= i + 1 - recent (causality not applied)
    q_pos = torch.tensor([0, 3, 7, 11])
    qw = query_window(q_pos, pos, sink, recent)
    assert qw.shape == (4, S) and qw.dtype == torch.bool
    for a, i in enumerate(q_pos.tolist()):
        assert qw[a].tolist() == [j < sink or j >= i + 1 - recent for j in range(S)]
        # a decode query at i = S' - 1 is in_window of S'
        assert torch.equal(qw[a], in_window(pos, i + 1, sink, recent))


# ---- the store ------------------------------------------------------------------------------
def _store(E=8, slots=40, H=2, d=4, layers=2):
    return ExactStore(slots, E, layers, H, d)


def _check_consistent(st: ExactStore):
    """entry_of and owner are inverse maps; free list = unused entries, each once."""
    E = st.capacity
    used = torch.nonzero(st.owner[1:] >= 0).flatten() + 1
    assert st.used() == used.numel()
    assert int(st.owner[0]) == -1  # entry 0 = "none", never owned
    for e in used.tolist():
        assert int(st.entry_of[st.owner[e]]) == e
    slots_with = torch.nonzero(st.entry_of > 0).flatten()
    assert slots_with.numel() == used.numel()
    assert torch.equal(st.owner[st.entry_of[slots_with]], slots_with)
    free = st._free[: st._nfree].tolist()
    assert len(free) == len(set(free)) == E - used.numel()
    assert set(free).isdisjoint(used.tolist()) and set(free) | set(used.tolist()) == set(range(1, E + 1))


def test_assign_keeps_only_where_keep():
    st = _store()
    slots = torch.tensor([5, 9, 2, 30, 7])
    keep = torch.tensor([True, False, True, True, False])
    ent = st.assign(slots, keep)
    assert ent.dtype == torch.int64 and ent.shape == (5,)
    assert bool((ent[keep] > 0).all()) and bool((ent[~keep] == 0).all())
    assert len(set(ent[keep].tolist())) == 3
    assert torch.equal(st.entry_of[slots], ent) and torch.equal(st.lookup(slots), ent)
    assert torch.equal(st.owner[ent[keep]], slots[keep])
    assert st.used() == 3
    assert bool((st.stamp[ent[keep]] == st.clock).all())
    _check_consistent(st)


def test_rewrite_outside_window_drops_and_kept_rewrite_reuses():
    st = _store()
    slots = torch.tensor([1, 2, 3])
    ent = st.assign(slots, torch.ones(3, dtype=torch.bool))
    st.tick()
    # slot 2 rewritten outside the window: its old entry goes back to the free list
    again = st.assign(torch.tensor([2, 3]), torch.tensor([False, True]))
    assert int(again[0]) == 0 and int(st.entry_of[2]) == 0 and int(st.owner[ent[1]]) == -1
    # slot 3 rewritten inside the window: the same entry, stamped now
    assert int(again[1]) == int(ent[2]) and int(st.stamp[ent[2]]) == st.clock
    assert int(st.stamp[ent[0]]) == st.clock - 1  # untouched slot 1 keeps its stamp
    assert st.used() == 2
    _check_consistent(st)
    # the freed entry is handed out again, never twice
    e4 = st.assign(torch.tensor([4]), torch.tensor([True]))
    assert int(e4[0]) not in (int(ent[0]), int(ent[2]))
    _check_consistent(st)


def test_release_slots_frees_and_touch_stamps():
    st = _store(E=4)
    slots = torch.tensor([10, 11, 12, 13])
    ent = st.assign(slots, torch.ones(4, dtype=torch.bool))
    assert st.used() == 4
    st.release_slots(torch.tensor([11, 13, 11, 20]))  # duplicates and a slot without an entry
    assert st.used() == 2 and st.entry_of[[11, 13]].tolist() == [0, 0]
    assert st.owner[ent[[1, 3]]].tolist() == [-1, -1]
    _check_consistent(st)
    st.release_slots(torch.tensor([11]))  # already released: nothing happens
    assert st.used() == 2
    _check_consistent(st)
    st.tick()
    st.touch(torch.tensor([12, 11]))
    assert int(st.stamp[ent[2]]) == st.clock and int(st.stamp[ent[0]]) == st.clock - 1
    # the released entries are reused before anything is evicted
    new = st.assign(torch.tensor([21, 22]), torch.ones(2, dtype=torch.bool))
    assert set(new.tolist()) == {int(ent[1]), int(ent[3])} and st.evictions == 0
    _check_consistent(st)


def test_lru_eviction_oldest_unpinned_never_pinned_or_current():
    st = _store(E=6, slots=200)
    calls = []
    for i in range(6):  # slot 100 + i stamped at clock 1 + i
        st.assign(torch.tensor([100 + i]), torch.tensor([True]), pinned=lambda: calls.append(1))
        st.tick()
    assert not calls  # pinned() is consulted only when eviction is needed
    ent = st.entry_of[100:106].clone()
    # 100 is the oldest but pinned: 101 and 102 go instead
    pinned = lambda: (calls.append(1), torch.tensor([100]))[1]  # noqa: E731
    new = st.assign(torch.tensor([7, 8]), torch.tensor([True, True]), pinned=pinned)
    assert calls and bool((new > 0).all())
    assert st.entry_of[100:106].tolist() == [int(ent[0]), 0, 0] + ent[3:].tolist()
    assert set(new.tolist()) == {int(ent[1]), int(ent[2])}
    assert st.evictions == 2
    _check_consistent(st)
    # entries stamped at the current clock are not evictable: 7 and 8 were just assigned, 100
    # pinned, 103..105 touched now; one more needs an eviction and there is none
    st.touch(torch.tensor([103, 104, 105]))
    with pytest.raises(ExactStoreFull, match=r"full.*6 entries.*1 more needed, 0 evictable"):
        st.assign(torch.tensor([9]), torch.tensor([True]), pinned=pinned)
    _check_consistent(st)
    assert int(st.entry_of[9]) == 0
    # next clock: every unpinned entry (7, 8, 103..105) was last used at the same clock; the
    # tie goes to the lowest entry (a stable sort over entries in order); 100 stays pinned
    st.tick()
    before = {s: int(st.entry_of[s]) for s in (7, 8, 100, 103, 104, 105)}
    e9 = st.assign(torch.tensor([9]), torch.tensor([True]), pinned=pinned)
    gone = [s for s, e in before.items() if int(st.entry_of[s]) != e]
    victim = min((e, s) for s, e in before.items() if s != 100)[1]
    assert gone == [victim] and int(e9[0]) == before[victim] and st.evictions == 3
    _check_consistent(st)


def test_eviction_protects_the_kept_slots_of_the_same_call():
    st = _store(E=3)
    st.assign(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.bool))
    st.tick()
    # rewrite slot 1 (kept: must keep its entry, though all three were last used at clock 1)
    # and add slot 4: the victim is the lower entry of slots 2 and 3, never slot 1's
    e1, e2, e3 = st.entry_of[1:4].tolist()
    ent = st.assign(torch.tensor([1, 4]), torch.tensor([True, True]))
    assert int(ent[0]) == e1 and int(st.entry_of[1]) == e1
    victim = 2 if e2 < e3 else 3
    assert int(st.entry_of[victim]) == 0 and int(st.entry_of[5 - victim]) == (e3 if victim == 2 else e2)
    assert int(ent[1]) == min(e2, e3) and st.evictions == 1
    _check_consistent(st)


def test_store_full_when_everything_is_pinned():
    st = _store(E=4)
    st.assign(torch.tensor([1, 2, 3, 4]), torch.ones(4, dtype=torch.bool))
    st.tick()
    with pytest.raises(ExactStoreFull, match=r"window store \(4 entries\) is full: 2 more needed, 0 evictable; "
                                             r"raise SGLANG_TASQ_WINDOW_ROWS"):
        st.assign(torch.tensor([5, 6]), torch.ones(2, dtype=torch.bool), pinned=lambda: torch.tensor([1, 2, 3, 4]))
    assert st.used() == 4 and st.entry_of[[5, 6]].tolist() == [0, 0]
    _check_consistent(st)
    # an empty store refuses any kept token
    empty = _store(E=0)
    with pytest.raises(ExactStoreFull):
        empty.assign(torch.tensor([1]), torch.tensor([True]))
    assert empty.assign(torch.tensor([1]), torch.tensor([False])).tolist() == [0]


def test_eviction_takes_a_batch_oldest_first():
    E = 64
    st = _store(E=E, slots=200)
    for i in range(E):
        st.assign(torch.tensor([i]), torch.tensor([True]))
        st.tick()
    new = st.assign(torch.tensor([150]), torch.tensor([True]))
    assert int(new[0]) > 0
    # E // 16 = 4 evicted at once (so eviction does not run at every step): the 4 oldest
    assert st.evictions == 4 and st.used() == E - 3
    assert st.entry_of[:4].tolist() == [0, 0, 0, 0] and bool((st.entry_of[4:E] > 0).all())
    _check_consistent(st)


def test_eviction_spares_kept_slots_while_anything_else_is_evictable():
    """Salient tokens: the entries of kept slots are paid for per slot and losing one cuts every
    cached prefix holding it, so an eviction takes window entries (even newer ones) first, and
    kept ones only when nothing else is left."""
    E = 32
    st = _store(E=E, slots=200)
    for i in range(E):  # slot i stamped at clock 1 + i
        st.assign(torch.tensor([i]), torch.tensor([True]))
        st.tick()
    st.kept[torch.arange(0, 16)] = 1  # the 16 oldest are kept (salient)
    new = st.assign(torch.tensor([150, 151, 152]), torch.ones(3, dtype=torch.bool))
    # max(3, E // 16 = 2) = 3 evicted: the oldest three that are not kept (slots 16..18)
    assert bool((new > 0).all()) and st.evictions == 3
    assert bool((st.entry_of[:16] > 0).all()) and st.entry_of[16:19].tolist() == [0, 0, 0]
    assert bool((st.entry_of[19:E] > 0).all())
    _check_consistent(st)
    # the batch's extra never reaches a kept entry: 13 window entries left, 14 needed -> the 13,
    # then the oldest kept one
    st.kept[torch.tensor([150, 151, 152])] = 1
    st.tick()
    st.assign(torch.arange(160, 174), torch.ones(14, dtype=torch.bool))
    assert st.evictions == 3 + 14
    assert int(st.entry_of[0]) == 0 and bool((st.entry_of[1:16] > 0).all())
    assert bool((st.entry_of[16:E] == 0).all())
    _check_consistent(st)


def test_free_list_overflow_is_refused():
    st = _store(E=2)
    e = st.assign(torch.tensor([1]), torch.tensor([True]))
    st.release_slots(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="released twice"):
        st._push(torch.cat([e, torch.tensor([2, 1])]))


class _Model:
    """The store in plain Python: slot -> entry, entry -> stamp, the free set."""

    def __init__(self, E):
        self.E, self.map, self.stamp, self.free, self.clock = E, {}, {}, set(range(1, E + 1)), 1

    def release(self, slots):
        for s in slots:
            e = self.map.pop(s, None)
            if e is not None:
                self.free.add(e)

    def evict(self, n, protect):
        used = {e: s for s, e in self.map.items()}
        cand = sorted((self.stamp[e], e) for e in used if e not in protect and self.stamp[e] < self.clock)
        if len(cand) < n:
            return None
        take = min(len(cand), max(n, self.E // 16))
        victims = [e for _, e in cand[:take]]
        for e in victims:
            del self.map[used[e]]
            self.free.add(e)
        return victims


def test_random_operations_match_a_python_model():
    rng = random.Random(7)
    fulls = 0
    for E in (5, 17, 40):
        st, m = _store(E=E, slots=60), _Model(E)
        n_evicted = n_full = 0
        for step in range(400):
            op = rng.random()
            if op < 0.15:
                st.tick()
                m.clock += 1
            elif op < 0.3:
                sl = [rng.randrange(60) for _ in range(rng.randrange(0, 6))]
                st.release_slots(torch.tensor(sl, dtype=torch.int64))
                m.release(sl)
            elif op < 0.4:
                sl = [rng.randrange(60) for _ in range(rng.randrange(0, 6))]
                st.touch(torch.tensor(sl, dtype=torch.int64))
                for s in sl:
                    if s in m.map:
                        m.stamp[m.map[s]] = m.clock
            else:
                sl = rng.sample(range(60), rng.randrange(1, 8))
                keep = [rng.random() < 0.7 for _ in sl]
                pin = rng.sample(range(60), rng.randrange(0, 10))
                m.release([s for s, k in zip(sl, keep) if not k])
                need = [s for s, k in zip(sl, keep) if k and s not in m.map]
                protect = {m.map[s] for s in pin + [s for s, k in zip(sl, keep) if k] if s in m.map}
                full = False
                if len(need) > len(m.free):
                    victims = m.evict(len(need) - len(m.free), protect)
                    full = victims is None
                    n_evicted += len(victims or [])
                free_before = set(m.free)
                try:
                    ent = st.assign(torch.tensor(sl), torch.tensor(keep), pinned=lambda: torch.tensor(pin, dtype=torch.int64))
                except ExactStoreFull:
                    assert full, step
                    n_full += 1
                else:
                    assert not full, step
                    for s, k, e in zip(sl, keep, ent.tolist()):
                        if not k:
                            assert e == 0
                            continue
                        assert e > 0
                        if s in m.map:
                            assert m.map[s] == e  # reused
                        else:
                            assert e in free_before  # a free entry, handed out once
                            m.free.discard(e)
                            m.map[s] = e
                        m.stamp[e] = m.clock
            # the store agrees with the model after every operation
            assert st.used() == len(m.map) == E - len(m.free), step
            assert {s: int(st.entry_of[s]) for s in range(60) if int(st.entry_of[s])} == m.map, step
            assert set(st._free[: st._nfree].tolist()) == m.free, step
            assert st.evictions == n_evicted
            for e in m.map.values():
                assert int(st.stamp[e]) == m.stamp[e]
            _check_consistent(st)
        assert n_evicted > 0  # the sequence did exercise eviction
        fulls += n_full
    assert fulls > 0  # ... and the refusal


def test_salient_entries_and_cell_bytes():
    """Salient tokens add budget / block of an exact entry per slot, fp16 echo scores of the layers
    up to the deciding one and a kept flag; the store also holds one entry per token a forward
    writes outside the recent window (until its block is decided)."""
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.packing import bytes_per_token
    from sglang_tasq.windows import (SLOT_INDEX_BYTES, cell_bytes, echo_row_width, entry_bytes, salient_entries,
                                     store_bytes)

    plain, sal = TaSQConfig(), TaSQConfig(salient_budget=36, salient_block=192, salient_layer=17)
    assert cell_bytes(plain, 3, 64, 30) == bytes_per_token(plain, 3, 64, 30) + SLOT_INDEX_BYTES
    assert echo_row_width(sal, 3) == 54 and echo_row_width(plain, 3) == 0
    extra = -(-36 * entry_bytes(3, 64, 30) // 192) + 2 * 54 + 1
    assert cell_bytes(sal, 3, 64, 30) == cell_bytes(plain, 3, 64, 30) + extra and isinstance(cell_bytes(sal, 3, 64, 30), int)
    assert salient_entries(plain, 1000, 4096) == 0
    assert salient_entries(sal, 1000, 256) == 188 and salient_entries(sal, 1000, 1024) == 188 + 768
    assert store_bytes(sal, 3, 64, 30, 4, 256) == store_bytes(plain, 3, 64, 30, 4)
    assert store_bytes(sal, 3, 64, 30, 4, 1280) == store_bytes(plain, 3, 64, 30, 4) + 1024 * entry_bytes(3, 64, 30)
    # fp8 copies (exact_format): an entry holds 1-byte codes and an fp16 scale per (layer, side, head)
    sal8 = TaSQConfig(salient_budget=36, salient_block=192, salient_layer=17, exact_format="fp8")
    assert entry_bytes(3, 64, 30, "fp8") == 2 * 3 * 66 * 30 + 25 and entry_bytes(3, 64, 30) == 2 * 3 * 128 * 30 + 25
    extra8 = -(-36 * entry_bytes(3, 64, 30, "fp8") // 192) + 2 * 54 + 1
    assert cell_bytes(sal8, 3, 64, 30) == cell_bytes(plain, 3, 64, 30) + extra8 < cell_bytes(sal, 3, 64, 30)
    assert store_bytes(sal8, 3, 64, 30, 4) == (4 * (64 + 512) + 1) * entry_bytes(3, 64, 30, "fp8") - 8
    # res4 copies: two residual nibbles a byte and an fp16 scale per (layer, side, head)
    sal4 = TaSQConfig(salient_budget=36, salient_block=192, salient_layer=17, exact_format="res4")
    assert entry_bytes(3, 64, 30, "res4") == 2 * 3 * 34 * 30 + 25
    assert cell_bytes(sal4, 3, 64, 30) == cell_bytes(plain, 3, 64, 30) + -(-36 * entry_bytes(3, 64, 30, "res4") // 192) \
        + 2 * 54 + 1 < cell_bytes(sal8, 3, 64, 30)


def test_a_kept_position_without_its_entry_cuts_the_prefix():
    present = torch.ones(12, dtype=torch.bool)
    kept = torch.zeros(12, dtype=torch.bool)
    kept[[3, 7]] = True
    assert exact_prefix_limit(present, 2, 3, kept) == 12
    present[7] = False  # a kept slot lost its entry: no query after it may be recomputed
    assert exact_prefix_limit(present, 2, 3, kept) == 7
    present[3] = False
    assert exact_prefix_limit(present, 2, 3, kept) == 3
    present[3] = True
    present[5] = False  # an ordinary hole inside the tail window of P' = 7 moves it back
    assert exact_prefix_limit(present, 2, 3, kept) == 5
    store = ExactStore(8, 4, 1, 1, 2)
    slots = torch.tensor([1, 2, 3])
    store.assign(slots, torch.ones(3, dtype=torch.bool))
    store.kept[slots] = 1
    store.assign(slots[:1], torch.zeros(1, dtype=torch.bool))  # a rewritten slot is a new token: not kept
    assert store.kept[slots].tolist() == [0, 1, 1]


def test_exact_store_holds_fp8_copies_with_a_scale_per_head():
    """``fmt="fp8"``: uint8 codes and an fp16 scale per (entry, head), read back as code x scale
    (:func:`salient.fp8_encode` / ``fp8_decode``), which is what ``held`` returns without a write;
    an unknown format is refused by name."""
    from sglang_tasq.salient import fp8_rows

    st = ExactStore(8, 4, 2, 3, 16, fmt="fp8")
    assert st.k[1].dtype == torch.uint8 and st.k_scale[1].shape == (5, 3) and st.k_scale[1].dtype == torch.float16
    k, v = torch.randn(2, 3, 16) * 5, torch.randn(2, 3, 16) * 1e-3
    ent = st.assign(torch.tensor([2, 6]), torch.ones(2, dtype=torch.bool))
    st.write(1, ent, k, v)
    rk, rv = st.read(1, ent)
    assert torch.equal(rk, fp8_rows(k)) and torch.equal(rv, fp8_rows(v)) and torch.equal(st.held(k), rk)
    assert torch.equal(st.read_k(1, ent), rk) and not bool(st.k[0].any())  # other layers untouched
    bf = ExactStore(8, 4, 2, 3, 16)
    assert bf.nbytes() - st.nbytes() == 2 * 2 * 5 * 3 * (16 * 2 - 16 - 2)  # layers x sides x entries x heads
    with pytest.raises(ValueError, match="exact store format 'fp4'"):
        ExactStore(8, 4, 1, 1, 2, fmt="fp4")


def test_cached_windows_are_sized_and_charged():
    """``SGLANG_TASQ_CACHED_WINDOWS``: room for finished sequences' sink + recent window, on top
    of the running rows', in the entries and in the fixed bytes charged to the KV budget."""
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.options import OptionError, ServeOptions
    from sglang_tasq.windows import entry_bytes, store_bytes, store_entries

    assert store_entries(64, 256, 4) == 4 * 576 and store_entries(64, 256, 4, cached=10) == 4 * 576 + 10 * 320
    assert store_entries(0, 0, 4, cached=10) == 0
    cfg = TaSQConfig()
    extra = store_bytes(cfg, 3, 64, 30, 4, cached=10) - store_bytes(cfg, 3, 64, 30, 4)
    assert extra == 10 * (cfg.sink_window + cfg.recent_window) * entry_bytes(3, 64, 30)
    assert ServeOptions.from_env({}).cached_windows == 0
    assert ServeOptions.from_env({"SGLANG_TASQ_CACHED_WINDOWS": "64"}).cached_windows == 64
    with pytest.raises(OptionError, match=r"SGLANG_TASQ_CACHED_WINDOWS=-1 must be >= 0"):
        ServeOptions.from_env({"SGLANG_TASQ_CACHED_WINDOWS": "-1"})
    with pytest.raises(OptionError, match=r"SGLANG_TASQ_CACHED_WINDOWS='many' is not an integer"):
        ServeOptions.from_env({"SGLANG_TASQ_CACHED_WINDOWS": "many"})


def test_exact_store_holds_res4_copies_over_the_slots_codes():
    """``fmt="res4"``: [E + 1, H, d / 2] nibbles and an fp16 scale per (entry, head) of what the
    slot's codes miss, read back over ``coded(layer, slots)`` (the pool's decode of the slot's
    codes; an entry's slot is its owner) as :func:`salient.res4_rows`, which is what ``held``
    returns for the same codes; without ``coded`` it is refused."""
    from sglang_tasq.salient import res4_rows

    codes = {}  # (layer, slot) -> what the slot's codes read as (k, v) [H, d]: stands for the pool's codes
    gen = torch.Generator().manual_seed(0)

    def coded(layer, slots, values=True):
        rows = [codes[(layer, int(s))] for s in slots]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]) if values else None

    st = ExactStore(8, 4, 2, 3, 16, fmt="res4", coded=coded)
    assert st.k[1].shape == (5, 3, 8) and st.k[1].dtype == torch.uint8 and st.k_scale[1].shape == (5, 3)
    k, v = torch.randn(2, 3, 16, generator=gen) * 5, torch.randn(2, 3, 16, generator=gen) * 1e-3
    for i, s in enumerate((2, 6)):
        codes[(1, s)] = (k[i] + torch.randn(3, 16, generator=gen), v[i] + 1e-4 * torch.randn(3, 16, generator=gen))
    ck, cv = coded(1, [2, 6])
    ent = st.assign(torch.tensor([2, 6]), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="pass coded="):
        st.write(1, ent, k, v)
    st.write(1, ent, k, v, (ck, cv))
    rk, rv = st.read(1, ent.flip(0))  # entries in any order read their own slots' codes
    assert torch.equal(rk, res4_rows(k, ck).flip(0)) and torch.equal(rv, res4_rows(v, cv).flip(0))
    assert torch.equal(st.read_k(1, ent), res4_rows(k, ck)) and torch.equal(st.held(k, ck), res4_rows(k, ck))
    assert float((rk.flip(0) - k).abs().max()) < float((ck - k).abs().max()) / 8
    bf = ExactStore(8, 4, 2, 3, 16)
    assert bf.nbytes() - st.nbytes() == 2 * 2 * 5 * 3 * (16 * 2 - 8 - 2)  # layers x sides x entries x heads
    with pytest.raises(ValueError, match="pass coded="):
        ExactStore(8, 4, 2, 3, 16, fmt="res4")
