"""Every environment variable sglang-tasq reads, read here and nowhere else.

Serving (:class:`ServeOptions`, parsed once per process by :meth:`ServeOptions.from_env`):

- ``SGLANG_TASQ_CONFIG``: the artifact path. ``--tasq-config PATH`` (or ``sglang.Engine(...,
  tasq_config=PATH)``) sets it in the launcher, and SGLang's spawned processes inherit it: it
  is the one thing the environment carries into them (:func:`export_config_path`).
- ``SGLANG_TASQ_WINDOW_ROWS``: how many requests the exact window store is sized for when
  ``--max-running-requests`` is not given (default 128); a larger explicit limit is refused.
  Inside the server the store is sized from the resolved ``--max-running-requests``.
- ``SGLANG_TASQ_CACHED_WINDOWS``: finished sequences whose sink and recent window the exact
  store keeps room for beyond the running requests (default 0), so that the radix cache can match
  them whole later (a follow-up turn, the same prompt again); a match whose window entries were
  evicted is cut there and the rest recomputed. Charged inside the KV budget.
- ``SGLANG_TASQ_CPU_KERNELS``: ``0`` serves the CPU path with the plain-torch reference
  instead of the Numba kernels (default 1).
- ``SGLANG_TASQ_CUDA_VIEW_TOKENS``: tokens of decoded keys the CUDA extend path materializes
  at once (default 32768).
- ``SGLANG_TASQ_PROFILE``: a file each TaSQ server process appends one line per forward to
  (its time and the backend's encode / codes / attention parts: :mod:`sglang_tasq.srt.profile`;
  unset by default: nothing timed). ``bench.prefill`` sets it.

Models outside the server (calibration, the quality benches): ``SGLANG_TASQ_DTYPE``, the
dtype the model computes in: ``auto`` (default: bfloat16, except on a CPU where torch has no
oneDNN bf16 matmul, e.g. AVX2-only x86, whose bf16 GEMMs run 7-11x slower than float32 there:
then float32; :func:`sglang_tasq.models.compute_dtype`), ``bfloat16`` or ``float32``.

Elsewhere: ``TASQ_CACHE`` (where models, corpora and artifacts are built once; default
``~/.cache/sglang-tasq``), and :func:`child_env` / :func:`passive_omp` for the processes the
benches and the demo start.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

ENV_CONFIG = "SGLANG_TASQ_CONFIG"
ENV_WINDOW_ROWS = "SGLANG_TASQ_WINDOW_ROWS"
ENV_CACHED_WINDOWS = "SGLANG_TASQ_CACHED_WINDOWS"
ENV_CPU_KERNELS = "SGLANG_TASQ_CPU_KERNELS"
ENV_CUDA_VIEW_TOKENS = "SGLANG_TASQ_CUDA_VIEW_TOKENS"
ENV_PROFILE = "SGLANG_TASQ_PROFILE"
ENV_DTYPE = "SGLANG_TASQ_DTYPE"
DTYPES = ("auto", "bfloat16", "float32")
DEFAULT_WINDOW_ROWS = 128
DEFAULT_CUDA_VIEW_TOKENS = 32768


class OptionError(ValueError):
    """An environment variable holds a value sglang-tasq cannot use (one line, names it)."""


def _int(env: Mapping[str, str], name: str, default: Optional[int], minimum: int = 1) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        val = int(raw)
    except ValueError:
        raise OptionError(f"tasq: {name}={raw!r} is not an integer") from None
    if val < minimum:
        raise OptionError(f"tasq: {name}={val} must be >= {minimum}")
    return val


@dataclass(frozen=True)
class ServeOptions:
    """How this process serves TaSQ. ``window_rows``: requests the exact store holds (``None``:
    not given; the plugin then uses ``--max-running-requests`` or :data:`DEFAULT_WINDOW_ROWS`)."""

    config_path: Optional[str] = None
    window_rows: Optional[int] = None
    # finished sequences whose sink + recent window the store has room for (for radix matches)
    cached_windows: int = 0
    cpu_kernels: bool = True
    cuda_view_tokens: int = DEFAULT_CUDA_VIEW_TOKENS
    # tokens one forward writes at most (chunked prefill size, else max prefill tokens): with
    # salient tokens each new token holds an exact entry until its block is decided
    forward_tokens: int = 16384

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "ServeOptions":
        env = os.environ if env is None else env
        kernels = env.get(ENV_CPU_KERNELS, "1").strip()
        if kernels not in ("0", "1", ""):
            raise OptionError(f"tasq: {ENV_CPU_KERNELS}={kernels!r}: use 0 (plain torch) or 1 (Numba kernels)")
        return cls(config_path=config_path(env),
                   window_rows=_int(env, ENV_WINDOW_ROWS, None),
                   cached_windows=_int(env, ENV_CACHED_WINDOWS, 0, minimum=0),
                   cpu_kernels=kernels != "0",
                   cuda_view_tokens=_int(env, ENV_CUDA_VIEW_TOKENS, DEFAULT_CUDA_VIEW_TOKENS))

    def rows(self) -> int:
        return self.window_rows if self.window_rows is not None else DEFAULT_WINDOW_ROWS


def config_path(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The artifact path (``SGLANG_TASQ_CONFIG``), or None when TaSQ is off. Read alone, so the
    plugin's per-call "is TaSQ on" check neither parses nor validates the other variables."""
    env = os.environ if env is None else env
    return env.get(ENV_CONFIG, "").strip() or None


def dtype_choice(env: Optional[Mapping[str, str]] = None) -> str:
    """``SGLANG_TASQ_DTYPE``: one of :data:`DTYPES` (default ``auto``)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_DTYPE, "").strip() or "auto"
    if raw not in DTYPES:
        raise OptionError(f"tasq: {ENV_DTYPE}={raw!r}: allowed {', '.join(DTYPES)}")
    return raw


def export_config_path(path) -> str:
    """Set the artifact path for this process and every process SGLang spawns from it."""
    p = os.path.abspath(str(path))
    os.environ[ENV_CONFIG] = p
    return p


def clear_config_path() -> None:
    os.environ.pop(ENV_CONFIG, None)


def cache_root() -> Path:
    return Path(os.environ.get("TASQ_CACHE", Path.home() / ".cache" / "sglang-tasq"))


def passive_omp() -> None:
    """OpenMP threads that spin while waiting slow torch down badly when processes share cores:
    make them sleep (call before torch starts its thread pool; an explicit setting wins)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def child_env(drop: tuple = (), **overrides: str) -> dict:
    """This process's environment for a child process, without ``drop``, with ``overrides``,
    and with sleeping OpenMP waits unless set otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def profile_path() -> Optional[str]:
    """Where the backend writes its per-forward time split (``SGLANG_TASQ_PROFILE``), or None."""
    return os.environ.get(ENV_PROFILE) or None


def set_env(name: str, value: str) -> None:
    """Set a variable in this process for itself and its children (a bench choosing a mode)."""
    os.environ[name] = str(value)


def default_env(name: str, value: str) -> None:
    """Set a variable for this process and its children unless it is set already."""
    os.environ.setdefault(name, str(value))
