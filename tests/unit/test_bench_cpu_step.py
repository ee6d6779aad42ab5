"""bench.cpu_step: its three decode steps run on a real TaSQ pool/backend (random SmolLM2-shaped
codebooks here); the served backend's decode tables are views of its encoder's codebook arrays,
the separate-tables variant's are its own copies."""
from __future__ import annotations

import types

import numpy as np

from bench import cpu_step
from sglang_tasq.config import TaSQConfig
from sglang_tasq.testing import random_codebooks


def test_steps_run_and_measure_reports_medians():
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, sink_window=4, recent_window=8)
    art = types.SimpleNamespace(codebooks=random_codebooks(cpu_step.L, cpu_step.H, cpu_step.D, cfg, seed=1), config=cfg)
    steps = {"tasq": cpu_step._tasq_setup(art, 2, 24, True), "sep": cpu_step._tasq_setup(art, 1, 24, False),
             "bf16": cpu_step._bf16_setup(2, 24)}
    res = cpu_step.measure(steps, reps=2, per_rep=1)  # small: compile time dominates here
    assert set(res) == set(steps)
    for r in res.values():
        assert len(r["ms"]) == 2 and r["median_ms"] > 0
    shared, separate = steps["tasq"].backend, steps["sep"].backend  # after the steps: tables built
    enc = shared.pool._encoder
    assert all(np.shares_memory(shared._decode_tables[i].kcb, enc.prepared(i)[0][2]) for i in range(cpu_step.L))
    assert not any(np.shares_memory(separate._decode_tables[i].kcb, separate.pool._encoder.prepared(i)[0][2])
                   for i in range(cpu_step.L))


def test_step_bytes_counts_codes_windows_indices_and_codebooks():
    """SmolLM2's default artifact shape (3 KV heads of 64, 8-dim groups, 1024 codewords, 62 code
    bytes per token and layer, sink 64 + recent 256): the bytes a decode step reads, by hand."""
    cfg = TaSQConfig(codebook_size_k=1024, codebook_size_v=1024)
    b = cpu_step.step_bytes(cfg, B=2, S=1025)
    books = 30 * 2 * (1024 * 3 * 8 * 8 * 4)
    assert b["tasq_codebooks"] == books == 47_185_920
    assert b["tasq"] == 2 * 30 * (705 * 62 + 320 * 768) + 2 * 1025 * 16 + books
    assert b["bf16"] == 2 * (30 * 1025 * 768 + 1025 * 8)
    short = cpu_step.step_bytes(cfg, B=1, S=100)  # every token inside the windows
    assert short["tasq"] - short["tasq_codebooks"] == 30 * 100 * 768 + 100 * 16


def test_markdown_table_names_bandwidth_and_rows():
    out = {"hardware": {"cpu": "X", "cores": 2}, "torch_threads": 2, "artifact": "a/tasq.json", "read_bandwidth_gb_s": 20.0,
           "rows": [{"batch": 1, "ctx": 1024, "tasq": {"median_ms": 10.0}, "bf16": {"median_ms": 20.0}, "tasq_vs_bf16": 0.5,
                     "bytes": {"tasq": 5e7, "tasq_codebooks": 4e7, "bf16": 2e7}, "tasq_gb_s": 5.0, "tasq_bw_share": 0.25,
                     "bf16_gb_s": 1.0, "bf16_bw_share": 0.05}]}
    md = cpu_step.to_markdown(out, 5)
    assert "20.0 GB/s" in md and "| 1 x 1024 | 10.0 | 20.0 | 0.5x | 50.0 (40.0) | 20.0 | 5.0 (25%) | 1.0 (5%) |" in md


def test_also_artifacts_prefill_through_the_backend_with_salient_tokens():
    """An ``--also`` artifact with salient tokens and res4 copies: its prompt goes through the
    backend's extend forward, so the step reads kept blocks (decided at the deciding layer) as
    well as the windows, and the decode steps run; the table names it against TaSQ."""
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, sink_window=4, recent_window=64, salient_budget=4,
                     salient_block=16, salient_layer=2, salient_after=4, exact_format="res4")
    art = types.SimpleNamespace(codebooks=random_codebooks(cpu_step.L, cpu_step.H, cpu_step.D, cfg, seed=2), config=cfg)
    step = cpu_step._tasq_setup(art, 2, 160, True, through_backend=True)
    pool = step.backend.pool
    kept = int((pool.exact.kept > 0).sum())
    assert kept >= 2 * 4 * 3  # 2 requests, >= 3 decided blocks of 16 (4 kept each) before the recent window
    step()
    step()
    out = {"hardware": {"cpu": "X", "cores": 2}, "torch_threads": 2, "artifact": "a/tasq.json", "read_bandwidth_gb_s": 20.0,
           "also": {"salient_res4": "b/tasq.json"},
           "rows": [{"batch": 1, "ctx": 1024, "tasq": {"median_ms": 10.0}, "bf16": {"median_ms": 20.0}, "tasq_vs_bf16": 0.5,
                     "bytes": {"tasq": 5e7, "tasq_codebooks": 4e7, "bf16": 2e7}, "tasq_gb_s": 5.0, "tasq_bw_share": 0.25,
                     "bf16_gb_s": 1.0, "bf16_bw_share": 0.05, "salient_res4": {"median_ms": 12.0}, "salient_res4_vs_tasq": 1.2}]}
    md = cpu_step.to_markdown(out, 5)
    assert "`salient_res4` = b/tasq.json" in md and "| 1 x 1024 | 10.0 | 12.0 (1.2x) |" in md
