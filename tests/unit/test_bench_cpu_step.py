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
