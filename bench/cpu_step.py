"""CPU decode-step benchmark: the TaSQ backend's decode step (encode the new token + attention,
every layer) against a bf16 pool read the way SGLang's ``torch_native`` backend reads it, in
one process, measured alternately.

What runs: the real ``TaSQTokenToKVPool`` and ``TaSQAttnBackend`` (Numba CPU kernels) on a
calibrated artifact's codebooks, SmolLM2-135M shapes (30 layers, 9 query / 3 KV heads, d = 64),
``B`` requests of ``ctx`` tokens prefilled through the backend, then decode steps; rows:

- ``tasq``: the backend as served (the encoder and the decode kernel share each layer's codebook
  arrays, so a step reads one copy);
- ``tasq_separate_tables``: the same with the decode kernel given its own copy of the tables
  (what the backend did before sharing: each layer's codebooks are read twice per step);
- ``bf16``: per layer, the new token's K/V stored into bf16 pool buffers, then per request a
  gather of its K/V by slot and ``scaled_dot_product_attention`` (GQA), as ``torch_native``.

Only attention and KV writes are timed (no GEMMs): the figure is the attention-side cost per
decode step. Writes ``cpu_step.json`` and ``cpu_step.md`` under ``--out``
(default ``bench/results/cpu_step/``). Usage: ``python -m bench.cpu_step [--ctx 1024]
[--batch 1 4] [--reps 7]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

from sglang_tasq.options import ServeOptions, passive_omp

passive_omp()  # before torch starts OpenMP

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "cpu_step"
DEFAULT_ARTIFACTS = (ROOT / "artifacts" / "smollm2" / "tasq.json", ROOT / "artifacts" / "smollm2-fast" / "tasq.json")
L, HQ, H, D = 30, 9, 3, 64  # SmolLM2-135M


class _Batch(types.SimpleNamespace):
    """The ForwardBatch fields the backend reads."""


def _tasq_setup(art, B: int, ctx: int, share: bool):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from numba_kernels import cpu
    from sglang_tasq.srt import pool as pool_mod
    from sglang_tasq.srt.backend import TaSQAttnBackend

    opts = ServeOptions(window_rows=B + 1)  # the exact store holds every request row
    pool = pool_mod.TaSQTokenToKVPool(size=B * (ctx + 8) + 8, page_size=1, dtype=torch.bfloat16, head_num=H,
                                      head_dim=D, layer_num=L, device="cpu", enable_memory_saver=False,
                                      artifact=art, options=opts)
    r2t = ReqToTokenPool(size=B + 1, max_context_len=ctx + 8, device="cpu", enable_memory_saver=False)
    be = TaSQAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool))
    if not share:  # the decode kernel's own copy of every layer's tables
        for lid in range(L):
            be._decode_tables[lid] = cpu.DecodeTables(art.codebooks, lid)
    layers = [types.SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=H, qk_head_dim=D, v_head_dim=D,
                                    scaling=D ** -0.5) for i in range(L)]
    rows = r2t.alloc_rows(B)
    gen = torch.Generator().manual_seed(0)
    loc = torch.arange(1, 1 + B * ctx)
    for b in range(B):
        r2t.req_to_token[rows[b], :ctx] = loc[b * ctx:(b + 1) * ctx].to(torch.int32)
    fb = _Batch(req_pool_indices=torch.tensor(rows), seq_lens=torch.full((B,), ctx, dtype=torch.int32),
                extend_prefix_lens=torch.zeros(B, dtype=torch.int32), extend_seq_lens=torch.full((B,), ctx, dtype=torch.int32),
                positions=torch.arange(ctx).repeat(B), out_cache_loc=loc, forward_mode=ForwardMode.EXTEND)
    be.init_forward_metadata(fb)
    for layer in layers:  # prefill through the backend: codes and rings hold real encodes
        k = torch.randn(B * ctx, H * D, generator=gen).bfloat16()
        be._forward(torch.randn(B * ctx, HQ * D, generator=gen).bfloat16(), k, torch.randn(B * ctx, H * D, generator=gen).bfloat16(),
                    layer, fb, True)
    new = torch.arange(1 + B * ctx, 1 + B * ctx + B)
    for b in range(B):
        r2t.req_to_token[rows[b], ctx] = int(new[b])
    fbd = _Batch(req_pool_indices=torch.tensor(rows), seq_lens=torch.full((B,), ctx + 1, dtype=torch.int32),
                 extend_prefix_lens=None, extend_seq_lens=None, positions=torch.full((B,), ctx), out_cache_loc=new,
                 forward_mode=ForwardMode.DECODE)
    q = torch.randn(B, HQ * D, generator=gen).bfloat16()
    kv = torch.randn(B, H * D, generator=gen).bfloat16()

    def step():
        be.init_forward_metadata(fbd)
        for layer in layers:
            be._forward(q, kv, kv, layer, fbd, True)
    step.backend = be
    return step


def _bf16_setup(B: int, ctx: int):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    n = B * (ctx + 1) + 1
    kbuf = [torch.randn(n, H, D, generator=gen).bfloat16() for _ in range(L)]
    vbuf = [torch.randn(n, H, D, generator=gen).bfloat16() for _ in range(L)]
    slots = [torch.arange(1 + b * (ctx + 1), 1 + (b + 1) * (ctx + 1)) for b in range(B)]
    new = torch.stack([s[-1] for s in slots])
    q = torch.randn(B, HQ, D, generator=gen).bfloat16()
    kv = torch.randn(B, H, D, generator=gen).bfloat16()

    def step():
        for lid in range(L):
            kbuf[lid][new] = kv
            vbuf[lid][new] = kv
            for b in range(B):
                k, v = kbuf[lid][slots[b]], vbuf[lid][slots[b]]
                F.scaled_dot_product_attention(q[b:b + 1].unsqueeze(2), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), scale=D ** -0.5, enable_gqa=True)
    return step


def measure(steps: dict, reps: int, per_rep: int = 3) -> dict:
    """Median ms per step of each function, measured round-robin (order reversed every other rep)."""
    for f in steps.values():
        f()
    times = {k: [] for k in steps}
    for r in range(reps):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.perf_counter()
            for _ in range(per_rep):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / per_rep * 1e3)
    return {k: {"median_ms": round(statistics.median(v), 2), "ms": [round(x, 2) for x in v]} for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_step", description=__doc__.split("\n")[0])
    ap.add_argument("--tasq-config", type=Path, default=None)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    path = a.tasq_config or next((p for p in DEFAULT_ARTIFACTS if p.is_file()), None)
    if path is None or not Path(path).is_file():
        ap.error("needs --tasq-config PATH (no calibrated artifact found; run `make calibrate`)")
    from numba_kernels import cpu
    from sglang_tasq.artifact import load_artifact

    from .serving import hardware

    art = load_artifact(str(path))
    if art.codebooks.k_codebook.shape[:2] != (L, H):
        ap.error(f"{path}: not a SmolLM2-135M artifact (layers/KV heads {tuple(art.codebooks.k_codebook.shape[:2])})")
    cpu.set_threads()
    rows = []
    for B in a.batch:
        print(f"[cpu_step] batch {B} x {a.ctx} tokens", flush=True)
        steps = {"tasq": _tasq_setup(art, B, a.ctx, True), "tasq_separate_tables": _tasq_setup(art, B, a.ctx, False),
                 "bf16": _bf16_setup(B, a.ctx)}
        res = measure(steps, a.reps)
        rows.append({"batch": B, "ctx": a.ctx, **res,
                     "tasq_vs_bf16": round(res["tasq"]["median_ms"] / res["bf16"]["median_ms"], 2),
                     "separate_vs_shared": round(res["tasq_separate_tables"]["median_ms"] / res["tasq"]["median_ms"], 2)})
    out = {"hardware": hardware(), "torch_threads": torch.get_num_threads(), "artifact": os.path.relpath(path, ROOT),
           "model_shapes": dict(layers=L, q_heads=HQ, kv_heads=H, head_dim=D), "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cpu_step.json").write_text(json.dumps(out, indent=1) + "\n")
    hw = out["hardware"]
    md = [f"# CPU decode step (attention side, {L} layers, SmolLM2-135M shapes)", "",
          f"Hardware: {hw['cpu']}, {hw['cores']} cores, torch {torch.__version__}, {out['torch_threads']} threads. "
          f"Artifact: {out['artifact']}. Median of {a.reps} alternating reps (3 steps each).", "",
          "| batch x ctx | TaSQ ms/step | TaSQ, separate tables | bf16 gather + SDPA | TaSQ / bf16 | separate / shared |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['batch']} x {r['ctx']} | {r['tasq']['median_ms']} | {r['tasq_separate_tables']['median_ms']} | "
                  f"{r['bf16']['median_ms']} | {r['tasq_vs_bf16']}x | {r['separate_vs_shared']}x |")
    (a.out / "cpu_step.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
