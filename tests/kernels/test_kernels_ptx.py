"""Every Numba kernel compiles to PTX for sm_90 without a GPU; hot kernels hold no float64.

Runs ``python -m numba_kernels.ptx_report`` in a child process (other tests may switch the
CUDA simulator on) and prints its table: .f64 count, local memory, and ptxas registers,
spills and shared memory when a ptxas binary is around. Needs NVVM, not a GPU: numba-cuda[cu13]
(``scripts/setup.sh``) ships it, so a missing NVVM is a broken set-up and fails the test.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tasq.options import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ptx_rows():
    env = child_env(drop=("NUMBA_ENABLE_CUDASIM",))
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-m", "numba_kernels.ptx_report"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0:
        hint = "\nNVVM missing: numba-cuda[cu13] provides it (make setup)" if "NVVM" in res.stderr else ""
        pytest.fail(f"ptx_report failed:{hint}\n{res.stderr[-4000:]}")
    return rows


def test_all_kernels_compile_for_sm90(ptx_rows):
    assert len(ptx_rows) >= 10
    print()
    for r in ptx_rows:
        print(f"{r['kernel']:60s} f64={r['f64']:3d} local={r['local_decls']}/{r['local_ldst']} "
              f"regs={r.get('registers')} spill={r.get('spill_stores')}/{r.get('spill_loads')} smem={r.get('smem')}")


def test_hot_kernels_have_no_float64(ptx_rows):
    bad = {r["kernel"]: r["f64"] for r in ptx_rows if r["hot"] and r["f64"]}
    assert not bad, f".f64 instructions in hot kernels: {bad}"


def test_no_local_memory_or_spills(ptx_rows):
    bad = {r["kernel"]: (r["local_decls"], r["local_ldst"], r.get("spill_stores")) for r in ptx_rows
           if r["local_decls"] or r["local_ldst"] or (r.get("spill_stores") or 0)}
    assert not bad, f"local memory / spills: {bad}"


def test_static_shared_memory_fits_48k(ptx_rows):
    bad = {r["kernel"]: r["smem"] for r in ptx_rows if (r.get("smem") or 0) > 48 * 1024}
    assert not bad, f"static shared memory over 48 KB: {bad}"
