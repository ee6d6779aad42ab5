"""Compile every kernel to PTX for sm_90 (no GPU needed) and report what matters.

``python -m numba_kernels.ptx_report`` prints one JSON line per kernel: ``.f64``
instruction count (must be 0 in hot kernels: float64 is 1/64 rate), local-memory
declarations and ld/st.local counts (spills or stack arrays), and, when a ``ptxas`` binary
is found (CUDA toolkit, or the one Triton ships), registers, spill bytes and static shared
memory as ptxas reports them. Representative static shapes: Llama-3.1-8B (32 q / 8 KV heads,
d=128) and SmolLM2-135M (9 / 3, d=64), g=8, K=1024.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def _specs():
    from . import attention, encode, extend

    out = []
    for H, d, rep in ((8, 128, 4), (3, 64, 3)):
        out += [
            attention.cache_kernel(H, d, 8, 1024, 10, 8, 1024, 10, rep, 1, "shared", "bf16"),
            attention.cache_kernel(H, d, 8, 1024, 10, 8, 1024, 10, rep, max(1, 8 // rep), "shared", "bf16", tiled=True),
            encode.argmin_kernel(H, d, 8, 1024, "bf16", True, "shared", "int64"),
            encode.argmin_kernel(H, d, 8, 1024, "bf16", False, "shared", "int64"),
            encode.scale_kernel(H, d, "bf16", False, "int64"),
            extend.chunk_kernel(d, rep, "bf16"),
            attention.reduce_kernel(d, False, False),
        ]
    out += [encode.pack_kernel(8 * 16, 10, 8 * 16, 10, "int64"),
            attention.cache_kernel(8, 128, 8, 1024, 10, 8, 1024, 10, 8, 1, "per_head", "f16"),
            attention.cache_kernel(3, 64, 8, 1024, 10, 8, 1024, 10, 3, 1, "shared", "bf16", has_kept=True)]
    return out


def _ptxas():
    found = shutil.which("ptxas")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            hits = glob.glob(os.path.join(root, "backends", "nvidia", "bin", "ptxas"))
            if hits:
                return hits[0]
    return None


def _ptxas_stats(ptxas: str, ptx: str) -> dict:
    """Registers / spills / smem from ``ptxas -v`` (the PTX version is lowered if ptxas is older)."""
    with tempfile.TemporaryDirectory() as tmp:
        for version in (None, "8.0"):
            src = ptx if version is None else re.sub(r"^\.version .*$", f".version {version}", ptx, flags=re.M)
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(src)
            res = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
            if res.returncode == 0:
                log = res.stderr + res.stdout
                get = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None  # noqa: E731
                return {"registers": get(r"Used (\d+) registers"), "spill_stores": get(r"(\d+) bytes spill stores"),
                        "spill_loads": get(r"(\d+) bytes spill loads"), "stack": get(r"(\d+) bytes stack frame"),
                        "smem": get(r"(\d+) bytes smem")}
    return {"ptxas_error": res.stderr[-300:]}


def ptx_stats(ptx: str) -> dict:
    body = [ln.split("//")[0] for ln in ptx.splitlines()]
    return {
        "f64": sum(1 for ln in body if ".f64" in ln),
        "local_decls": sum(1 for ln in body if re.match(r"\s*\.local\s", ln)),
        "local_ldst": sum(1 for ln in body if re.search(r"\b(ld|st)\.local", ln)),
        "lines": len(body),
    }


def main() -> int:
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        print(json.dumps({"error": "unset NUMBA_ENABLE_CUDASIM: PTX needs the real compiler"}))
        return 2
    ptxas = _ptxas()
    for spec in _specs():
        ptx, _ = cuda.compile_ptx(spec.fn, spec.sig, cc=(9, 0))
        row = {"kernel": spec.name, "hot": spec.hot, **ptx_stats(ptx)}
        if ptxas:
            row.update(_ptxas_stats(ptxas, ptx))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
