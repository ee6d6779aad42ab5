"""Numba CUDA kernels of TaSQ: encode into a packed pool, split-K decode and extend attention.

Modules: ``tables`` (one layer's kernel-ready codebooks, :class:`LayerTables`), ``devfns``
(device helpers; GPU vs simulator twins), ``encode`` (scale, nearest codeword, packing),
``attention`` (group-major split-K attention over the compressed cache + split reduction),
``extend`` (causal chunk part of prefill), ``ops`` (launch wrappers: ``encode_kv``,
``decode_attention``, ``extend_attention``), ``reference`` (plain-torch twins built on
sglang_tasq.codec), ``sim_cases`` / ``ptx_report`` (test drivers run in child processes),
``fastpath`` (Numba CPU kernels or plain torch for the CPU hot paths), and the package ``cpu``
(Numba CPU ``njit`` kernels of the CPU serving path and the HF cache, split like the CUDA half:
``cpu._common`` threads, intrinsics and views; ``cpu.search``; ``cpu.bitpack``; ``cpu.decode``
and ``cpu.encode`` kernels; ``cpu.ops`` launch objects ``DecodeTables``, ``DecodePlan``,
``PoolEncoder``).
Importing this package does not import numba; ``ops`` and ``cpu`` do.
"""
