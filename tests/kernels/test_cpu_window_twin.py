"""The decode kernel's window test (``numba_kernels.cpu.decode._window_entry``, Numba cannot call
torch) is a twin of the one definition of the rule, ``sglang_tasq.windows.in_window``: equal
over a grid of (t, S, sink, recent) with the edge cases (sink 0, recent 0, S < sink, windows
longer than the request, t at every boundary)."""
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
_ENTRY_OF = np.array([0, _ENTRY], np.int64)  # slot 0: no exact entry; slot 1: entry 7


@njit(cache=False)
def _grid(entry_of, slot, S, sink, recent, out):
    """_window_entry for t = 0..S, called from compiled code as the kernel calls it (inlined)."""
    for t in range(S + 1):
        out[t] = _window_entry(entry_of, slot, t, S, sink, recent)


def _rule(S, sink, recent):
    """[S + 1] bool: windows.in_window for positions 0..S of a query at S - 1 (t = S one past the
    request's end, where the formula still has to agree)."""
    return in_window(torch.arange(S + 1), S, sink, recent).numpy()


def test_the_package_reexports_the_twin():
    assert cpu._window_entry is _window_entry


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("recent", RECENTS)
def test_window_entry_equals_windows_in_window(sink, recent):
    for S in LENGTHS:
        want = _rule(S, sink, recent)
        got = np.empty(S + 1, np.int64)
        _grid(_ENTRY_OF, 1, S, sink, recent, got)
        assert np.array_equal(got >= 0, want), (S, sink, recent, got, want)
        assert set(got[want].tolist()) <= {_ENTRY} and not (got[~want] != -1).any()
        # the Python-level dispatcher (the same function compiled standalone) agrees pointwise
        for t in range(S + 1):
            assert _window_entry(_ENTRY_OF, 1, t, S, sink, recent) == (_ENTRY if want[t] else -1)


@pytest.mark.parametrize("sink,recent", [(0, 0), (3, 0), (0, 4), (2, 3), (16, 16)])
def test_window_entry_reads_codes_without_an_entry_or_without_windows(sink, recent):
    """A slot whose entry is 0 (none), or an empty entry_of (no windows), reads codes (-1)."""
    for S in LENGTHS:
        for entry_of, slot in ((_ENTRY_OF, 0), (np.zeros(0, np.int64), 0)):
            got = np.empty(S + 1, np.int64)
            _grid(entry_of, slot, S, sink, recent, got)
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
    assert _window_entry(_ENTRY_OF, 1, t, S, sink, recent) == (_ENTRY if inside else -1)
