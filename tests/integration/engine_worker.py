"""Run a real ``sglang.Engine`` (CPU) in its own process and print JSON results.

SGLang kills the parent of an engine that fails to start, so tests never start one in the
pytest process: they run ``python tests/integration/engine_worker.py SPEC.json`` and read the last stdout
line (one JSON object). SPEC: ``{"engine": {Engine kwargs}, "tasq_config": path or null,
"tasks": [{"op": "generate", "prompt": str or [str], "input_ids": optional, "sampling_params":
{...}, "return_logprob": bool, "top_logprobs_num": optional k (each step's top-k [log-prob, id]),
"logprob_start_len": optional (the prompt's teacher-forced log-probs from there)}, {"op": "flush"}, {"op": "info"}]}``. A launch refusal prints
its one line on stderr and exits 2.

``make_random_artifact(out_dir, model_path, **config)`` writes a wiring-only artifact with
random codebooks (garbage quality, valid format) for the served model. The test helpers
``run_worker``, ``chat_ids``, ``first_parting`` and ``reference_logprobs`` (the HF TaSQ cache, independent of
SGLang) live here too; ``model_dir`` and ``pick_artifact`` come from ``tests/_support.py`` (in
pytest, use the ``smollm2_dir`` and ``artifact`` fixtures of ``tests/conftest.py``).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # run as a script (sys.path[0] is tests/integration)
    sys.path.insert(0, str(TESTS))

from _support import ROOT, pick_artifact  # noqa: E402,F401  (pick_artifact: re-exported)
from sglang_tasq.options import child_env, clear_config_path, export_config_path  # noqa: E402

WORKER = ROOT / "tests" / "integration" / "engine_worker.py"


def run_worker(spec: dict, tmp_dir: Path, name: str, timeout: int = 900, env: dict | None = None):
    """-> (returncode, parsed JSON or None, stderr)."""
    path = tmp_dir / f"{name}.json"
    path.write_text(json.dumps(spec))
    e = child_env(drop=("SGLANG_TASQ_CONFIG",), **(env or {}))
    p = subprocess.run([sys.executable, str(WORKER), str(path)], capture_output=True, text=True,
                       timeout=timeout, env=e, cwd=str(ROOT))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return p.returncode, (json.loads(lines[-1]) if lines else None), p.stderr


def chat_ids(tokenizer, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def reference_logprobs(model_path, codebooks, prompt_ids: list[int], out_ids: list[int], sink: int,
                       recent: int) -> list[float]:
    """Teacher-forced log-probs of ``out_ids`` after ``prompt_ids`` with the model at ``model_path``
    and the HF TaSQ cache fed one token at a time, so every query (prompt ones included) reads
    the window rule of ``sglang_tasq.windows`` exactly as the served engine does (key j exact
    iff j < sink or j >= i + 1 - recent, codes otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_tasq.hf.cache import TaSQCache

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    model.eval()
    cache = TaSQCache(codebooks, sink=sink, recent=recent, fresh_exact=True, model=model)  # model: salient artifacts
    seq, out = list(prompt_ids) + list(out_ids), []
    with torch.no_grad():
        for i, t in enumerate(seq[:-1]):
            logits = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1]
            if i >= len(prompt_ids) - 1:
                out.append(float(torch.log_softmax(logits.float(), -1)[seq[i + 1]]))
    return out


def make_random_artifact(out_dir, model_path, seed: int = 0, **config) -> Path:
    """Random valid codebooks for the shapes of the model at ``model_path`` -> DIR/tasq.json (wiring
    tests only)."""
    from sglang_tasq.artifact import save_artifact
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.models import fingerprint, load_config
    from sglang_tasq.testing import random_codebooks

    fp = fingerprint(load_config(model_path))
    cfg = TaSQConfig(**config)
    cb = random_codebooks(fp.num_layers, fp.num_kv_heads, fp.head_dim, config=cfg, seed=seed,
                          rope_theta=fp.rope_theta)
    return save_artifact(out_dir, cb, fp, calibration={"kind": "random", "seed": seed})


def first_parting(got: list[int], want: list[int], want_top: list) -> tuple | None:
    """Where greedy outputs ``got`` and ``want`` first differ: None if they do not, else
    (step, the ``want`` run's own top-1 minus top-2 log-prob there, its top-2 ids), from the
    ``top_logprobs`` (k >= 2) the engine returned with ``want``. A parting at a small gap is a
    near-tie flipped by float order; both tokens must then be the reference's top 2. A run
    that stops early (EOS) parts at the shorter length."""
    if got == want:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i >= len(want_top):
        return i, 0.0, []
    step = sorted(want_top[i], key=lambda e: -e[0])
    return i, float(step[0][0] - step[1][0]), [int(step[0][1]), int(step[1][1])]


def assert_same_or_near_tie(got: list[int], want: list[int], want_top: list, tie: float) -> None:
    """``got == want``, or the two part at a near-tie of the ``want`` run: its own top-2 gap at the
    parting step below ``tie``, both tokens among its top 2 (see :func:`first_parting`)."""
    p = first_parting(got, want, want_top)
    if p is None:
        return
    i, gap, top2 = p
    print(f"parting at step {i}: reference top-2 gap {gap:.3f} nats, top 2 {top2}")
    assert i < min(len(got), len(want)), (got, want)  # one is a prefix of the other: not a tie
    assert gap < tie and {got[i], want[i]} <= set(top2), (i, gap, top2, tie, got, want)


def output_drift(got: dict, want: dict) -> float:
    """Largest |difference| of the chosen tokens' log-probs of two engine outputs
    (``output_ids``, ``output_logprobs``; ``top_logprobs`` for ``want``) before they first part."""
    p = first_parting(got["output_ids"], want["output_ids"], want["top_logprobs"])
    n = len(want["output_ids"]) if p is None else p[0]
    return max((abs(a - b) for (a, _), (b, _) in zip(got["output_logprobs"][:n], want["output_logprobs"][:n])),
               default=0.0)


def assert_same_up_to_rounding(got: dict, want: dict, tie: float, drift: float) -> None:
    """Two engine outputs for one request (``output_ids``, ``output_logprobs``, and ``top_logprobs``
    with k >= 2 for ``want``) whose float order differs (alone vs in a batch, a whole prompt vs a
    radix-matched suffix): the tokens as :func:`assert_same_or_near_tie` with ``tie``, and the
    chosen tokens' log-probs before any parting within ``drift`` of each other (:func:`output_drift`),
    so reading other data is caught even where the tokens happen to agree."""
    assert_same_or_near_tie(got["output_ids"], want["output_ids"], want["top_logprobs"], tie)
    worst = output_drift(got, want)
    print(f"log-prob drift before any parting: {worst:.4f} nats (bound {drift})")
    assert worst < drift, (worst, got["output_logprobs"], want["output_logprobs"])


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
                "attention_backend": info.get("attention_backend"),
                "kvcache_gb": (states[0].get("memory_usage") or {}).get("kvcache")}
    if op == "generate":
        kw = dict(sampling_params=task.get("sampling_params", {}), return_logprob=task.get("return_logprob", False))
        if task.get("top_logprobs_num"):  # the engine's own top-k log-probs at each output step
            kw.update(return_logprob=True, top_logprobs_num=int(task["top_logprobs_num"]))
        if task.get("logprob_start_len") is not None:  # teacher-forced log-probs of the prompt from there
            kw.update(return_logprob=True, logprob_start_len=int(task["logprob_start_len"]))
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
            if task.get("return_logprob") or task.get("top_logprobs_num"):
                r["output_logprobs"] = [[lp, tid] for lp, tid, *_ in meta.get("output_token_logprobs", [])]
            if task.get("logprob_start_len") is not None:
                r["input_logprobs"] = [lp for lp, *_ in meta.get("input_token_logprobs", []) if lp is not None]
            if task.get("top_logprobs_num"):
                r["top_logprobs"] = [[[lp, tid] for lp, tid, *_ in step] for step in meta.get("output_top_logprobs", [])]
            res.append(r)
        return {"op": op, "outputs": res}
    raise ValueError(f"unknown op {op!r}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("tasq_config"):
        export_config_path(spec["tasq_config"])
    else:
        clear_config_path()
    import sglang
    from sglang_tasq.srt.launch import TaSQLaunchError, refuse

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
