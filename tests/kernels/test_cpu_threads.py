"""The Numba kernels leave torch's thread count alone (a fresh process: the state is per process)."""
import os
import subprocess
import sys

from _support import ROOT

SCRIPT = """
import torch
torch.set_num_threads(1)
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's OpenMP pool up, as after a model has run
from numba_kernels import cpu
from sglang_tasq.testing import random_codebooks
cpu.set_threads()
cb = random_codebooks(1, 2, 16).v_codebook[0]
cpu.nearest(torch.randn(300, 2, 2, 8), cpu.prepare(cb))  # a parallel launch starts Numba's pool
print(torch.get_num_threads())
"""


def test_torch_keeps_its_thread_count_after_a_parallel_kernel():
    """Numba's OpenMP layer sets the process's OpenMP threads to NUMBA_NUM_THREADS when its pool
    starts; without ``set_threads`` giving torch its count back this prints 2."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "1"
