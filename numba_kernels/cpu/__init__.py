"""Numba CPU kernels (``njit``, parallel over tokens or (request, KV head)): the CPU serving
path's encode and decode attention, and the fast nearest-codeword search used by the HF cache.

Each kernel has a plain-torch twin in :mod:`sglang_tasq.codec`, and the tests hold them to it:

- :func:`nearest` == ``codec.nearest_codeword`` (argmin of ``|c|^2 - 2 x.c``, first index on
  ties). The products are summed in a fixed order, so on exact near-ties (distance gaps at
  float32 rounding) the chosen index can differ from torch's matmul; the chosen codeword's
  distance then equals the minimum up to rounding.
- :func:`pack` / :func:`unpack` == ``packing.pack_codes`` / ``packing.unpack_codes`` (bit-exact).
- :func:`decode_attention` == ``codec.attention_over_codes`` for one query per request at
  position ``S - 1`` (decode), with the pool's sink/recent window rule: a token reads its
  full-precision window entry when it lies in the window of ``S`` and the entry holds it.

Modules (split the way the CUDA half of :mod:`numba_kernels` is):

- ``_common``: thread count (:func:`set_threads`), shared constants, LLVM intrinsics and bit
  casts (fp16 / bf16 <-> f32), numpy view helpers of the host wrappers.
- ``search``: nearest-codeword kernels (codeword-vector, lane, one-row) and
  :func:`prepare` / :func:`nearest` (cached per layer by ``codec.LayerNearest``).
- ``bitpack``: the one Numba bit-pack loop (``_pack_row``, used by :func:`pack` and the fused
  encoder's row writer), :func:`pack` / :func:`unpack`, ``_codes_row`` (the decode kernel's reader).
- ``decode``: the split-K decode attention kernel and ``_window_entry`` (the Numba twin of
  ``sglang_tasq.windows.in_window``, or'd with a per-slot kept flag: salient tokens).
- ``echo``: :func:`query_echo`, the salient window echo of a prefill chunk (each query over its
  own sink and recent window only; twin of ``sglang_tasq.salient.query_echo``).
- ``encode``: the fused pool encode kernels (key un-rotation and tailoring, row writer, the
  one-call decode-step encoder ``_encode_small``).
- ``ops``: the host-side launch objects: :class:`DecodeTables`, :class:`DecodePlan`,
  :func:`decode_attention`, :class:`PoolEncoder`, :func:`rope_composes` (whether the decode kernel may
  compose RoPE rows).

Numba compiles each kernel on first use (cached on disk next to its module, ``cache=True``);
``set_threads`` matches Numba's thread count to torch's. Numba keys a cached kernel by its own
module's source file only: after editing a module whose functions others inline (``_common``,
``search``, ``bitpack``), clear ``numba_kernels/cpu/__pycache__`` so no stale kernel is loaded.
(No module is named after a function it exports, so ``cpu.nearest`` / ``cpu.pack`` are the
functions and ``numba_kernels.cpu.search`` / ``.bitpack`` the modules, unambiguously.)
"""
from ._common import _SERIAL_BELOW, set_threads  # noqa: F401  (_SERIAL_BELOW: tests)
from .bitpack import _codes_row, pack, unpack  # noqa: F401  (_codes_row: tests)
from .decode import _window_entry  # noqa: F401  (the window-rule twin: tests)
from .echo import query_echo
from .encode import _encode_small  # noqa: F401
from .ops import SPLIT_TOKENS, DecodePlan, DecodeTables, PoolEncoder, decode_attention, rope_composes
from .search import nearest, prepare

__all__ = ["set_threads", "prepare", "nearest", "pack", "unpack", "SPLIT_TOKENS",
           "DecodeTables", "DecodePlan", "decode_attention", "PoolEncoder", "rope_composes", "query_echo"]
