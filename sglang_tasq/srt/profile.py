"""Where a served forward's time goes on the TaSQ backend, for benchmarks.

``SGLANG_TASQ_PROFILE=PATH`` makes every TaSQ server process append one JSON line per forward to
PATH::

    {"pid": 123, "mode": "extend", "tokens": 4096, "forward_s": 3.91,
     "parts_s": {"store": 0.61, "codes": 0.35, "attention": 1.95}}

``forward_s``: wall time from the backend's ``init_forward_metadata`` to the end of the last
layer's attention (the model forward without sampling); ``parts_s``: the backend's own parts,
summed over layers — ``store`` (``set_kv_buffer``: un-rotate, tailor, nearest-codeword search,
pack, write rows and window entries: the encode), ``codes`` (extend: decoding the request's
codes and gathering its exact keys for the window rule), ``attention`` (extend:
``windowed_prefill``; decode: the Numba decode kernel or the torch path). Unset (the default),
nothing is timed and nothing is written.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

from ..options import ENV_PROFILE as ENV
from ..options import profile_path


class ForwardProfile:
    """Per-forward accumulator; :meth:`begin` at the forward's metadata, :meth:`part` around
    each timed piece, :meth:`end` after the last layer (writes the line)."""

    def __init__(self, path: str | None):
        self.path = path or None
        self._t0 = None
        self._parts: dict = {}
        self._mode = ""
        self._tokens = 0

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def begin(self, mode: str, tokens: int) -> None:
        if self.path is None:
            return
        self._t0 = time.perf_counter()
        self._parts = {}
        self._mode, self._tokens = mode, int(tokens)

    @contextmanager
    def part(self, name: str):
        if self.path is None or self._t0 is None:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self._parts[name] = self._parts.get(name, 0.0) + time.perf_counter() - t

    def end(self) -> None:
        if self.path is None or self._t0 is None:
            return
        rec = {"pid": os.getpid(), "mode": self._mode, "tokens": self._tokens,
               "forward_s": round(time.perf_counter() - self._t0, 6),
               "parts_s": {k: round(v, 6) for k, v in self._parts.items()}}
        self._t0 = None
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def from_env() -> ForwardProfile:
    return ForwardProfile(profile_path())


def read(path) -> list:
    """The records of a profile file (missing file: none)."""
    try:
        text = open(path).read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
