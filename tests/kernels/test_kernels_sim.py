"""Numba kernels vs the plain-torch references, in the CUDA simulator (no GPU needed).

The simulator must be switched on before numba is first imported, and other test modules
import numba for real, so the cases run in child processes (``python -m
numba_kernels.sim_cases GROUP``), two at a time. Each child prints one JSON line per case.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tasq.options import child_env

ROOT = Path(__file__).resolve().parents[2]
BATCHES = (("encode", "rope", "extend"), ("decode",))
GROUPS = [g for batch in BATCHES for g in batch]


@pytest.fixture(scope="module")
def sim_results():
    env = child_env(NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "numba_kernels.sim_cases", *batch], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for batch in BATCHES]
    results, errors = {}, []
    for p in procs:
        out, err = p.communicate(timeout=900)
        for line in out.splitlines():
            if line.startswith("{"):
                res = json.loads(line)
                results[res["case"]] = res
        if p.returncode not in (0, 1):
            errors.append(err[-3000:])
    return results, errors


@pytest.mark.parametrize("group", GROUPS)
def test_kernels_match_reference_in_simulator(sim_results, group):
    results, errors = sim_results
    assert not errors, "simulator child crashed:\n" + "\n".join(errors)
    mine = {k: v for k, v in results.items() if k.startswith({"encode": "enc_", "decode": "dec_",
                                                              "extend": "ext_", "rope": "rope_"}[group])}
    assert mine, f"no {group} cases ran"
    bad = {k: v.get("error", "") + "\n" + v.get("trace", "") for k, v in mine.items() if not v["ok"]}
    for k, v in sorted(mine.items()):
        print(f"{k}: ok={v['ok']} secs={v['secs']} " + " ".join(f"{a}={b}" for a, b in v.items()
                                                                 if a in ("err", "near_ties")))
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_wrappers_reject_bad_inputs():
    """The launch wrappers name the bad value before any kernel runs (no GPU, no simulator needed)."""
    import torch

    from numba_kernels import ops
    from numba_kernels.tables import LayerTables
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.testing import random_codebooks

    tb = LayerTables.from_codebooks(random_codebooks(1, 2, 16, TaSQConfig(codebook_size_k=64, codebook_size_v=64)), 0)
    pool = tb.allocate_pool(8)
    q = torch.randn(1, 4, 16)
    ptr, idx = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    args = (pool["k_codes"], pool["v_codes"], pool["k_scale"])
    with pytest.raises(TypeError, match="kv_indptr"):
        ops.decode_attention(q, *args, ptr.long(), idx, tb, 0.25)
    with pytest.raises(ValueError, match="k_full"):
        ops.decode_attention(q, *args, ptr, idx, tb, 0.25, sink=1)
    with pytest.raises(ValueError, match="k_codes"):
        ops.decode_attention(q, pool["k_codes"][:, :-1].contiguous(), *args[1:], ptr, idx, tb, 0.25)
    with pytest.raises(ValueError, match="q: shape"):
        ops.decode_attention(torch.randn(1, 3, 16), *args, ptr, idx, tb, 0.25)
    kept = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kept slots are read from k_full"):
        ops.decode_attention(q, *args, ptr, idx, tb, 0.25, kept=kept)
    full = torch.zeros(8, 2, 16, dtype=torch.float16)
    with pytest.raises((TypeError, ValueError), match="kept"):
        ops.decode_attention(q, *args, ptr, idx, tb, 0.25, full, full, kept=kept.bool())
    with pytest.raises((TypeError, ValueError), match="kept"):
        ops.decode_attention(q, *args, ptr, idx, tb, 0.25, full, full, kept=kept[:5])
    with pytest.raises(TypeError, match="loc"):
        ops.encode_kv(torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.zeros(2, dtype=torch.int16), tb, *args)
    with pytest.raises(ValueError, match="dense key weighting"):
        cb = random_codebooks(1, 2, 16, TaSQConfig(codebook_size_k=64, codebook_size_v=64))
        cb.k_mix = torch.eye(16).expand(1, 2, 16, 16)
        LayerTables.from_codebooks(cb, 0)
