"""Serving at several devices: answers of ``launch_server --tp N`` / ``--dp N`` against TP/DP 1.

    python -m bench.parallel --tasq-config artifacts/tp3/tasq.json [--servers bf16@tp1 bf16@tp3
        tasq@tp1 tasq@tp3 tasq@dp2] [--new-tokens 24]

Each server (a real ``sglang.launch_server`` on CPU, one at a time; more than one rank per NUMA
node needs ``SGLANG_CPU_OMP_THREADS_BIND``, set here to one core per rank, ranks sharing the
machine's cores round-robin) answers the same greedy chat requests through the OpenAI API (each
on a flushed cache, so no answer depends on what the radix cache holds from earlier ones), and
returns the prompts' teacher-forced log-probs through ``/generate``. Each parallel server is
compared with its kind at degree 1 (``tasq@tp3`` with ``tasq@tp1``): identical answers, and the
largest log-prob difference ("drift"), next to bf16's own drift at the same degree (TP sums in
another order). Written to ``bench/results/parallel/<workload>/parallel.json`` (+ ``.md``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_tasq.options import child_env, passive_omp

passive_omp()

from sglang_tasq.demo import _free_port, _get, _post, haystack, stop_server, wait_ready  # noqa: E402
from sglang_tasq.models import resolve_model  # noqa: E402

from .serving_report import hardware  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "parallel"
QUESTIONS = [haystack(), "What is the capital of France? Answer in one sentence.",
             haystack().replace("7421", "5093"), "Write a haiku about the sea.",
             haystack(90).replace("7421", "86"), "Name three colours and one fruit."]


def parse_server(spec: str) -> tuple[str, str, int]:
    """'tasq@tp3' -> ('tasq', 'tp', 3)."""
    kind, _, deg = spec.partition("@")
    if kind not in ("bf16", "tasq") or deg[:2] not in ("tp", "dp") or not deg[2:].isdigit() or int(deg[2:]) < 1:
        raise argparse.ArgumentTypeError(f"server {spec!r}: expected bf16|tasq @ tpN|dpN, e.g. tasq@tp3")
    return kind, deg[:2], int(deg[2:])


def flush(base: str, wait_s: float = 120) -> None:
    """Empty the radix cache; SGLang refuses while a request (its start-up warm-up included) is
    still in flight, so retry until it is idle."""
    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(base + "/flush_cache?timeout=10", method="POST"),
                                   timeout=60).read()
            return
        except urllib.error.HTTPError:
            if time.time() - t0 > wait_s:
                raise
            time.sleep(1)


def serve_and_ask(spec: str, a, model_dir: Path, prompt_ids: list, log_dir: Path) -> dict:
    kind, axis, n = parse_server(spec)
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "cpu",
           "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--max-total-tokens", "16384",
           "--max-running-requests", "4", "--host", "127.0.0.1", "--port", str(port), f"--{axis}", str(n)]
    cmd += ["--tasq-config", str(a.tasq_config)] if kind == "tasq" else ["--attention-backend", "torch_native"]
    env = child_env(drop=("SGLANG_TASQ_CONFIG",))
    if n > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(n))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[parallel] {spec}: {' '.join(cmd[2:])}", flush=True)
    with open(log_dir / f"{spec}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base, t0 = f"http://127.0.0.1:{port}", time.time()
    try:
        wait_ready(base, proc, timeout=600)
    except (RuntimeError, TimeoutError) as e:
        stop_server(proc)
        tail = (log_dir / f"{spec}.log").read_text(errors="replace").strip().splitlines()[-2:]
        return {"status": "failed", "reason": f"{e}: {' | '.join(tail)}"[-600:]}
    try:
        startup = round(time.time() - t0, 1)
        answers = []
        for q in QUESTIONS:  # each alone on a cold cache: the answer is the request's, not the cache state's
            flush(base)
            r = _post(base + "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": q}],
                                                      "temperature": 0, "max_tokens": a.new_tokens})
            answers.append(r["choices"][0]["message"]["content"])
        r = _post(base + "/generate", {"input_ids": prompt_ids, "return_logprob": True, "logprob_start_len": 0,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
        lps = [[lp for lp, *_ in o["meta_info"]["input_token_logprobs"] if lp is not None] for o in r]
        info = _get(base + "/get_server_info")
        return {"status": "ok", "startup_s": startup, "answers": answers, "prompt_logprobs": lps,
                "attention_backend": info.get("attention_backend"), "tp_size": info.get("tp_size"),
                "dp_size": info.get("dp_size")}
    finally:
        stop_server(proc)


def drift(x: dict, y: dict) -> float:
    return max(abs(p - q) for a, b in zip(x["prompt_logprobs"], y["prompt_logprobs"]) for p, q in zip(a, b))


def report(res: dict) -> str:
    s = res["servers"]
    hw = res["hardware"]
    hw = f"{hw.get('cpu')}, {hw.get('cores')} cores, {hw.get('mem_gib')} GiB" if isinstance(hw, dict) else hw
    lines = [f"# Serving at TP/DP > 1 ({hw}; SmolLM2-135M-Instruct; {len(QUESTIONS)} greedy chat requests of "
             f"{res['new_tokens']} tokens, each alone on a flushed cache; artifact {res['artifact']})", "",
             "| server | vs | same answers | prompt log-prob drift (nats) | bf16's drift at that degree | startup s |",
             "|---|---|---|---|---|---|"]
    for name, r in s.items():
        kind, axis, n = parse_server(name)
        ref = s.get(f"{kind}@tp1")
        if r.get("status") != "ok":
            lines.append(f"| {name} | | failed: {r.get('reason', '')[:120]} | | | |")
            continue
        if n == 1 or not ref or ref.get("status") != "ok":
            lines.append(f"| {name} | (reference) | | | | {r['startup_s']} |")
            continue
        same = sum(a == b for a, b in zip(r["answers"], ref["answers"]))
        bf, bref = s.get(f"bf16@{axis}{n}"), s.get("bf16@tp1")
        bfd = f"{drift(bf, bref):.3f}" if bf and bref and bf.get("status") == bref.get("status") == "ok" else "-"
        lines.append(f"| {name} | {kind}@tp1 | {same}/{len(r['answers'])} | {drift(r, ref):.3f} | {bfd} | {r['startup_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasq-config", type=Path, required=True, help="a TaSQ artifact (tasq.json), e.g. from calibrate --tp 3")
    ap.add_argument("--servers", nargs="+", default=["bf16@tp1", "bf16@tp3", "tasq@tp1", "tasq@tp3", "tasq@dp2"])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, help="results folder (default: bench/results/parallel/<workload>)")
    a = ap.parse_args(argv)
    for spec in a.servers:
        parse_server(spec)
    model_dir = resolve_model("smollm2-135m")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [list(tok(q)["input_ids"]) for q in QUESTIONS[:3]]
    digest = hashlib.sha256((a.tasq_config.parent / "tasq.safetensors").read_bytes()).hexdigest()[:8]
    key = hashlib.sha256(json.dumps([a.servers, a.new_tokens, digest]).encode()).hexdigest()[:8]
    out = a.out or RESULTS / f"smollm2-135m_{key}"
    res = {"hardware": hardware(), "artifact": f"{a.tasq_config} (tensors sha256 {digest}...)",
           "new_tokens": a.new_tokens, "servers": {}}
    for spec in a.servers:
        res["servers"][spec] = serve_and_ask(spec, a, model_dir, prompt_ids, out / "logs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps(res, indent=1))
    md = report(res)
    (out / "parallel.md").write_text(md)
    print(md)
    print(f"[parallel] wrote {out}/parallel.json and parallel.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
