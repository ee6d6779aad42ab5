"""The decode kernel's exact-read test (``numba_kernels.cpu.decode._window_entry``, Numba cannot
call torch) is a twin of the one definition of the window rule, ``sglang_tasq.windows.in_window``,
or'd with the slot's kept flag: equal to ``in_window(...) | kept[slot]`` over a grid of
(t, S, sink, recent) with the edge cases (sink 0, recent 0, S < sink, windows longer than the
request, t at every boundary), for a kept and an unkept slot and without kept tokens (an empty
``kept``); a slot without an entry, or no windows at all, reads codes, kept or not."""
import numpy as np
import pytest
import torch
from numba import njit

from numba_kernels import cpu
from numba_kernels.cpu.decode import _window_entry
from sglang_tasq.windows import in_window

SINKS = [0, 1, 2, 3, 5, 16]
RECENTS = [0, 1, 2, 4, 7, 16]
LENGTHS = list(range(0, 13)) + [31]

_ENTRY = 7
_ENTRY_OF = np.array([0, _ENTRY, _ENTRY, 0], np.int64)  # slots 0, 3: no exact entry; slots 1, 2: entry 7
_KEPT = np.array([1, 0, 3, 1], np.uint8)  # kept: slots 0, 2 (any non-zero), 3; slot 1 not
_NONE_KEPT = np.zeros(0, np.uint8)  # no kept tokens (the plan's default)


@njit(cache=False)
def _grid(entry_of, kept, slot, S, sink, recent, out):
    """_window_entry for t = 0..S, called from compiled code as the kernel calls it (inlined)."""
    for t in range(S + 1):
        out[t] = _window_entry(entry_of, kept, slot, t, S, sink, recent)


def _rule(S, sink, recent, kept=False):
    """[S + 1] bool: windows.in_window for positions 0..S of a query at S - 1 (t = S one past the
    request's end, where the formula still has to agree), or'd with the slot's kept flag."""
    return (in_window(torch.arange(S + 1), S, sink, recent) | torch.tensor(bool(kept))).numpy()


def test_the_package_reexports_the_twin():
    assert cpu._window_entry is _window_entry


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("recent", RECENTS)
def test_window_entry_equals_windows_in_window_or_kept(sink, recent):
    """Slot 1 (entry, not kept) and slot 2 (entry, kept) against ``in_window | kept[slot]``,
    with the kept array and without one (empty: the window rule alone)."""
    for S in LENGTHS:
        for kept, slot in ((_KEPT, 1), (_KEPT, 2), (_NONE_KEPT, 1), (_NONE_KEPT, 2)):
            want = _rule(S, sink, recent, kept.shape[0] > 0 and kept[slot] != 0)
            got = np.empty(S + 1, np.int64)
            _grid(_ENTRY_OF, kept, slot, S, sink, recent, got)
            assert np.array_equal(got >= 0, want), (S, sink, recent, slot, kept, got, want)
            assert set(got[want].tolist()) <= {_ENTRY} and not (got[~want] != -1).any()
            # the Python-level dispatcher (the same function compiled standalone) agrees pointwise
            for t in range(S + 1):
                assert _window_entry(_ENTRY_OF, kept, slot, t, S, sink, recent) == (_ENTRY if want[t] else -1)


def test_window_entry_kept_slots_read_their_entry_everywhere():
    """A kept slot with an entry reads it at every position, in and out of the window; kept
    flags are per slot (any non-zero byte, or a bool array viewed as uint8)."""
    kept_bool = np.array([False, False, True, True])
    for kept in (_KEPT, kept_bool.view(np.uint8)):
        for S in LENGTHS:
            got = np.empty(S + 1, np.int64)
            _grid(_ENTRY_OF, kept, 2, S, 2, 3, got)
            assert (got == _ENTRY).all()


@pytest.mark.parametrize("sink,recent", [(0, 0), (3, 0), (0, 4), (2, 3), (16, 16)])
def test_window_entry_reads_codes_without_an_entry_or_without_windows(sink, recent):
    """A slot whose entry is 0 (none; kept or not), or an empty entry_of (no windows; kept
    slots included), reads codes (-1)."""
    empty = np.zeros(0, np.int64)
    for S in LENGTHS:
        for entry_of, kept, slot in ((_ENTRY_OF, _NONE_KEPT, 0), (_ENTRY_OF, _KEPT, 0), (_ENTRY_OF, _KEPT, 3),
                                     (empty, _NONE_KEPT, 0), (empty, _KEPT, 2)):
            got = np.empty(S + 1, np.int64)
            _grid(entry_of, kept, slot, S, sink, recent, got)
            assert (got == -1).all()


@pytest.mark.parametrize("t,S,sink,recent,inside", [
    (0, 1, 0, 0, False),    # no windows at all
    (0, 1, 1, 0, True),     # the sink's only position
    (1, 5, 1, 0, False),    # first position past the sink
    (0, 5, 0, 1, False),    # recent 1: only the query's own position S - 1 ...
    (4, 5, 0, 1, True),     # ... is in the window
    (3, 5, 0, 2, True),     # S - recent exactly: inside
    (2, 5, 0, 2, False),    # S - recent - 1: outside
    (2, 3, 5, 0, True),     # S < sink: every position is in the sink
    (0, 3, 0, 7, True),     # recent > S: every position is recent
    (3, 8, 3, 4, False),    # between sink and recent: codes
    (4, 8, 3, 4, True),     # first recent position
    (2, 8, 3, 4, True),     # last sink position
])
def test_window_entry_boundaries(t, S, sink, recent, inside):
    assert bool(in_window(torch.tensor([t]), S, sink, recent)[0]) is inside
    assert _window_entry(_ENTRY_OF, _NONE_KEPT, 1, t, S, sink, recent) == (_ENTRY if inside else -1)
    assert _window_entry(_ENTRY_OF, _KEPT, 1, t, S, sink, recent) == (_ENTRY if inside else -1)  # slot 1 not kept
    assert _window_entry(_ENTRY_OF, _KEPT, 2, t, S, sink, recent) == _ENTRY  # kept: exact either side
