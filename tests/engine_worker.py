"""Run a real ``sglang.Engine`` (CPU) in its own process and print JSON results.

SGLang kills the parent of an engine that fails to start, so tests never start one in the
pytest process: they run ``python tests/engine_worker.py SPEC.json`` and read the last stdout
line (one JSON object). SPEC: ``{"engine": {Engine kwargs}, "tasq_config": path or null,
"tasks": [{"op": "generate", "prompt": str or [str], "input_ids": optional, "sampling_params":
{...}, "return_logprob": bool}, {"op": "flush"}, {"op": "info"}]}``. A launch refusal prints
its one line on stderr and exits 2.

``make_random_artifact(out_dir, model_dir, **config)`` writes a wiring-only artifact with
random codebooks (garbage quality, valid format) for the served model.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def make_random_artifact(out_dir, model_dir, seed: int = 0, **config) -> Path:
    """Random valid codebooks for ``model_dir``'s shapes -> DIR/tasq.json (wiring tests only)."""
    from sglang_tasq.artifact import save_artifact
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.models import fingerprint, load_config
    from sglang_tasq.testing import random_codebooks

    fp = fingerprint(load_config(model_dir))
    cfg = TaSQConfig(**config)
    cb = random_codebooks(fp.num_layers, fp.num_kv_heads, fp.head_dim, config=cfg, seed=seed,
                          rope_theta=fp.rope_theta)
    return save_artifact(out_dir, cb, fp, calibration={"kind": "random", "seed": seed})


def _run_task(engine, task: dict) -> dict:
    op = task["op"]
    if op == "flush":
        engine.flush_cache()
        return {"op": op}
    if op == "info":
        info = engine.get_server_info()
        states = info.get("internal_states") or [{}]
        return {"op": op, "max_total_num_tokens": info.get("max_total_num_tokens",
                                                           states[0].get("max_total_num_tokens")),
                "attention_backend": info.get("attention_backend")}
    if op == "generate":
        kw = dict(sampling_params=task.get("sampling_params", {}), return_logprob=task.get("return_logprob", False))
        if "input_ids" in task:
            kw["input_ids"] = task["input_ids"]
        else:
            kw["prompt"] = task["prompt"]
        out = engine.generate(**kw)
        outs = out if isinstance(out, list) else [out]
        res = []
        for o in outs:
            meta = o.get("meta_info", {})
            r = {"text": o.get("text"), "output_ids": o.get("output_ids")}
            if task.get("return_logprob"):
                r["output_logprobs"] = [[lp, tid] for lp, tid, *_ in meta.get("output_token_logprobs", [])]
            res.append(r)
        return {"op": op, "outputs": res}
    raise ValueError(f"unknown op {op!r}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("tasq_config"):
        os.environ["SGLANG_TASQ_CONFIG"] = str(spec["tasq_config"])
    else:
        os.environ.pop("SGLANG_TASQ_CONFIG", None)
    import sglang
    from sglang_tasq.launch import TaSQLaunchError, refuse

    kwargs = dict(device="cpu", disable_cuda_graph=True, mem_fraction_static=0.3, log_level="error")
    kwargs.update(spec.get("engine", {}))
    try:
        engine = sglang.Engine(**kwargs)
    except TaSQLaunchError as e:
        refuse(e)
    try:
        results = [_run_task(engine, t) for t in spec.get("tasks", [])]
    finally:
        engine.shutdown()
    print(json.dumps({"results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
