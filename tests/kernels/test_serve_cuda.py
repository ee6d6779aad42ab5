"""The CUDA adapter (sglang_tasq.srt.serve_cuda) vs the backend's CPU path, in the Numba CUDA simulator.

The simulator must be on before numba is imported, so the check runs this file as a child
script (``NUMBA_ENABLE_CUDASIM=1 python tests/kernels/test_serve_cuda.py``), which prints one JSON line.
Setup: a real TaSQTokenToKVPool on CPU (head_dim 16, 2 layers, 2 KV heads, GQA 2, sink 2,
recent 3, fp16-exact random codebooks) with its slot-keyed exact store, three ragged requests
(1 starts on request 0's first 4 slots, a radix-shared prefix whose exact entries are request
0's, read after request 0 has moved past them), chunked prefill (2 extends, with chunk tokens
outside later queries' windows: the strict per-query rule) then 2 decodes. Pool A is written by
the adapter (Numba encode), pool B by the CPU path; checked: pool bytes, entry assignment and
exact entries agree (codes up to rare near-ties), the adapter's attention equals the CPU path
reading the SAME pool (fp32 windows: tight; bf16 windows, the serving default: loose), and the
CPU path on pool B.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_tasq.options import child_env, set_env

ROOT = Path(__file__).resolve().parents[2]
REQ_ROWS = 4  # ReqToTokenPool size of _setup


@dataclass
class Batch:
    """ForwardBatch fields the backend and the adapter read."""
    req_pool_indices: object
    seq_lens: object
    extend_prefix_lens: object
    extend_seq_lens: object
    positions: object
    out_cache_loc: object
    forward_mode: object


def _setup(window_rows: str, mixed: bool = False, exact_format: str = "bf16"):
    """Two (pool, backend) pairs on CPU. ``window_rows`` sizes the exact store
    (SGLANG_TASQ_WINDOW_ROWS); raised to the ReqToTokenPool size (4) when smaller, as
    ``attach_request_rows`` requires. ``mixed``: a per-layer key rate (layer 1's keys in groups
    of 4 of 16 codewords: key rows of another width than layer 0's). ``exact_format``: the exact
    store's copies (bf16, or fp8 codes with fp16 scales)."""
    from _pools import make_backend, make_pool

    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.testing import random_codebooks

    mix = dict(mix_layers=(1,), mix_group_size_k=4, mix_codebook_size_k=16) if mixed else {}
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, sink_window=2, recent_window=3,
                     exact_format=exact_format, **mix)
    cb = random_codebooks(2, 2, 16, cfg, seed=3)
    cb.k_codebook = tuple(c.half().float() for c in cb.k_codebook) if mixed else cb.k_codebook.half().float()
    cb.v_codebook = cb.v_codebook.half().float()
    pools = [make_pool(cb, 96, max(int(window_rows), REQ_ROWS)) for _ in range(2)]
    return pools, [make_backend(p, REQ_ROWS) for p in pools]


def _strict_pairs(prefix: int, seq: int, sink: int, recent: int) -> int:
    """(query, chunk key) pairs of one extend that the rule reads from codes."""
    return sum(1 for i in range(prefix, seq) for j in range(prefix, i + 1) if sink <= j < i + 1 - recent)


def _sim_main(mixed: bool = False, exact_format: str = "bf16") -> dict:
    import types

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_tasq.srt.serve_cuda import TaSQCudaAdapter

    (pool_a, pool_b), (be_a, be_b) = _setup("2", mixed, exact_format)
    assert pool_a.exact.capacity == REQ_ROWS * (2 + 2 * 3)
    rows = [be.req_to_token_pool.alloc_rows(3) for be in (be_a, be_b)]
    assert rows[0] == rows[1]
    rows = rows[0]
    ad32 = TaSQCudaAdapter(pool_a, be_a.req_to_token_pool, full_dtype=torch.float32)
    # the serving default (bf16 view rows for a bf16 store, f32 for an fp8 one), 1 request per group
    ad16 = TaSQCudaAdapter(pool_a, be_a.req_to_token_pool, max_view_tokens=4)
    res0 = {"view_dtype": str(ad16.full_dtype)}
    layers = [types.SimpleNamespace(layer_id=i, tp_q_head_num=4, tp_k_head_num=2, qk_head_dim=16, v_head_dim=16,
                                    scaling=0.25) for i in range(2)]
    gen = torch.Generator().manual_seed(7)
    free = torch.randperm(95, generator=gen) + 1
    # request 1 starts on request 0's first 4 slots (a shared radix prefix: all 4 hold entries,
    # written inside request 0's first chunk), while request 0 moves on past them
    steps = [("extend", {0: 4, 2: 6}), ("extend", {0: 5, 1: 3, 2: 3}), ("decode", {0: 1, 1: 1, 2: 1}),
             ("decode", {0: 1, 1: 1, 2: 1})]
    lens, used = [0, 4, 0], 0
    res = {"tight": 0.0, "loose": 0.0, "other_pool": 0.0, "code_mismatch": 0, "codes": 0, "exact": 0.0,
           "strict_pairs": 0, "shared_entries": 0}
    for mode, batch in steps:
        reqs, new = list(batch), list(batch.values())
        loc = free[used : used + sum(new)]
        used += sum(new)
        pos, off = [], 0
        for b, t in batch.items():
            for be in (be_a, be_b):
                r2t = be.req_to_token_pool.req_to_token
                if b == 1 and lens[1] == 4:
                    r2t[rows[1], :4] = r2t[rows[0], :4]
                r2t[rows[b], lens[b] : lens[b] + t] = loc[off : off + t].to(torch.int32)
            pos += list(range(lens[b], lens[b] + t))
            off += t
        prefix = [lens[b] for b in reqs]
        for b, t in batch.items():
            lens[b] += t
        if mode == "extend":
            res["strict_pairs"] += sum(_strict_pairs(p, lens[b], 2, 3) for p, b in zip(prefix, reqs))
        fb = Batch(req_pool_indices=torch.tensor([rows[b] for b in reqs]),
                   seq_lens=torch.tensor([lens[b] for b in reqs], dtype=torch.int32),
                   extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                   extend_seq_lens=torch.tensor(new, dtype=torch.int32), positions=torch.tensor(pos),
                   out_cache_loc=loc.clone(), forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
        for be in (be_a, be_b):
            be.init_forward_metadata(fb)
        assert torch.equal(be_a.forward_metadata["win_targets"][0], be_b.forward_metadata["win_targets"][0])
        if 1 in batch and prefix[reqs.index(1)] == 4:
            r2t = be_a.req_to_token_pool.req_to_token
            shared = pool_a.exact.entry_of[r2t[rows[1], :4].long()]
            assert bool((shared > 0).all()) and torch.equal(shared, pool_a.exact.entry_of[r2t[rows[0], :4].long()])
            res["shared_entries"] += int(shared.numel())
        md16 = dict(be_a.forward_metadata)
        for layer in layers:
            N = sum(new)
            q = torch.randn(N, 4 * 16, generator=gen)
            k, v = torch.randn(N, 2 * 16, generator=gen) * 2, torch.randn(N, 2 * 16, generator=gen)
            got = ad32.forward(q.view(N, 4, 16), k, v, layer, fb, be_a.forward_metadata).reshape(N, -1)
            got16 = ad16.forward(q.view(N, 4, 16), k, v, layer, fb, md16, save_kv_cache=False).reshape(N, -1)
            want = be_a._forward(q, k, v, layer, fb, save_kv_cache=False)
            other = be_b._forward(q, k, v, layer, fb, save_kv_cache=True)
            scale = float(want.abs().max())
            res["tight"] = max(res["tight"], float((got - want).abs().max()) / scale)
            res["loose"] = max(res["loose"], float((got16 - want).abs().max()) / scale)
            res["other_pool"] = max(res["other_pool"], float((got - other).abs().max()) / scale)
            lid = layer.layer_id
            res["code_mismatch"] += int((pool_a.k_buffer[lid] != pool_b.k_buffer[lid]).any(1).sum())
            res["code_mismatch"] += int((pool_a.v_buffer[lid] != pool_b.v_buffer[lid]).any(1).sum())
            res["codes"] += 2 * used
            # entry 0 ("none") is the adapter's never-read dump for tokens outside every window
            ea, eb = pool_a.exact, pool_b.exact
            every = torch.arange(1, ea.capacity + 1)
            (ka, va), (kb, vb) = ea.read(lid, every), eb.read(lid, every)
            res["exact"] = max(res["exact"], float((ka - kb).abs().max()), float((va - vb).abs().max()))
    res["entries_equal"] = bool(torch.equal(pool_a.exact.entry_of, pool_b.exact.entry_of)
                                and torch.equal(pool_a.exact.owner, pool_b.exact.owner))
    res["entries_used"] = pool_a.exact.used()
    res["entries_written"] = bool((pool_a.exact.k[0][1:pool_a.exact.used() + 1] != 0).any(-1).any(-1).all())
    res["plan_groups"] = [len(be_a.forward_metadata["tasq_cuda_plan"]), len(md16["tasq_cuda_plan"])]
    res["key_row_bytes"] = [int(b.shape[1]) for b in pool_a.k_buffer]
    return {**res0, **res}


@pytest.mark.parametrize("mixed,fmt", [(False, "bf16"), (True, "bf16"), (False, "fp8"), (False, "res4")],
                         ids=["one_key_rate", "per_layer_key_rate", "fp8_store", "res4_store"])
def test_adapter_matches_cpu_path_in_simulator(mixed, fmt):
    env = child_env(NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    args = (["mixed"] if mixed else []) + ([fmt] if fmt != "bf16" else [])
    p = subprocess.run([sys.executable, str(Path(__file__).resolve())] + args, cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    res = json.loads(lines[-1])
    print(res)
    assert res["plan_groups"] == [1, 3]
    assert res["key_row_bytes"] == ([3 + 2, 4 + 2] if mixed else [3 + 2, 3 + 2])  # codes + the fp16 scale
    assert res["strict_pairs"] > 0 and res["shared_entries"] == 4, res
    assert res["tight"] < 1e-4, res
    # bf16 view rows (the serving default for a bf16 store) round; an fp8 or res4 store's are f32: tight
    assert res["view_dtype"] == ("torch.bfloat16" if fmt == "bf16" else "torch.float32"), res
    assert res["loose"] < (3e-2 if fmt == "bf16" else 1e-4), res
    assert res["code_mismatch"] <= max(1, res["codes"] // 50), res
    assert res["exact"] < 1e-2 and res["entries_equal"], res
    assert res["entries_used"] > 0 and res["entries_written"], res
    if res["code_mismatch"] == 0:
        assert res["other_pool"] < 1e-4, res


if __name__ == "__main__":
    set_env("NUMBA_ENABLE_CUDASIM", "1")
    fmts = [a for a in sys.argv[1:] if a in ("fp8", "res4")]
    print(json.dumps(_sim_main(mixed="mixed" in sys.argv[1:], exact_format=fmts[0] if fmts else "bf16")), flush=True)
