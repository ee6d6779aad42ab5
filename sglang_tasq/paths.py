"""Where sglang-tasq keeps what it builds once: the materialized model, corpora, artifacts.

``TASQ_CACHE`` overrides the default ``~/.cache/sglang-tasq``.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("TASQ_CACHE", Path.home() / ".cache" / "sglang-tasq"))
    p = root.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p
