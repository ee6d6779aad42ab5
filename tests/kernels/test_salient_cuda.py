"""Salient tokens on the CUDA path (sglang_tasq.srt.serve_cuda), in the Numba CUDA simulator.

The simulator must be on before numba is imported, so the check runs this file as a child
script (``NUMBA_ENABLE_CUDASIM=1 python tests/kernels/test_salient_cuda.py``), which prints one
JSON line. Setup: the pool, data and driver of test_salient_pool.py (3 layers, deciding layer 1,
blocks of 8 keeping 2, sink 2, recent 41; codebooks made fp16-exact, as the device tables hold
them); one request of 54 tokens prefilled in uneven chunks, then 2 decode steps, every layer
through the backend's CUDA branch (``_forward_adapter``: the adapter's store, the backend's echo
and decision between store and attention, torch extend, the Numba decode kernel with kept flags) and, on the same pool, through the CPU path. Checked: the kept slots are
the plain-torch reference decision, the adapter's attention equals the CPU path's at every layer
and position (fp32 windows), and the decode steps do read kept slots outside the windows.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tasq.options import child_env

ROOT = Path(__file__).resolve().parents[2]


def _sim_main(exact_format: str = "bf16") -> dict:
    import types

    import torch

    import test_salient_pool as sp
    from sglang_tasq import salient as sal
    from sglang_tasq.srt.backend import TaSQAttnBackend
    from sglang_tasq.srt.serve_cuda import TaSQCudaAdapter

    pool, r2t, be, _, cb = sp._setup(exact_format=exact_format)
    for t in (cb.k_codebook, cb.v_codebook):  # fp16-exact, as the device tables hold them
        t.copy_(t.half().float())
    be._cuda = TaSQCudaAdapter(pool, r2t, full_dtype=torch.float32 if exact_format == "bf16" else None)
    be._forward = be._forward_adapter  # every layer through the backend's CUDA branch
    cpu = TaSQAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool))
    cpu._decode_kernel = False  # the torch reader: the plainest CPU path
    data = sp._data()
    row = r2t.alloc_rows(1)[0]
    run = sp.Runner(pool, r2t, be, row, list(range(1, 600)))
    for n in (23, 1, 30):  # Runner asserts the CPU path on the same pool gives the same rows
        run.forward(n, data, other=cpu)
    for _ in range(2):
        run.forward(1, data, decode=True, other=cpu)
    S, kept = run.S, run.kept()
    return {"kept": kept, "want": sp._reference_kept(cb, data, S, exact_format), "S": S,
            "fmt": pool.exact.fmt, "view_dtype": str(be._cuda.full_dtype),
            "kept_outside": sum(1 for p in kept if sp.SINK <= p < S - sp.RECENT),
            "decided": sal.decided_blocks(S, pool.salient), "outputs": len(run.out)}


@pytest.mark.slow  # ~2 min each: the simulator runs the encode kernel a thread at a time
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "res4"])
def test_cuda_path_serves_salient_tokens_in_simulator(fmt):
    """(fp8: an fp8 exact store, its copies written by the adapter and read into f32 view rows;
    res4: residuals over the codes the adapter wrote, read likewise.)"""
    env = child_env(NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), fmt], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    res = json.loads(lines[-1])
    print({k: v for k, v in res.items() if k not in ("kept", "want")})
    assert res["kept"] == res["want"] and len(res["kept"]) == 2 * res["decided"] > 0, res
    assert res["kept_outside"] > 0, res  # the decode steps read kept slots from the exact store
    assert res["outputs"] == 3 * res["S"], res
    assert res["fmt"] == fmt and res["view_dtype"] == "torch.float32", res


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(_sim_main(sys.argv[1] if len(sys.argv) > 1 else "bf16")))
