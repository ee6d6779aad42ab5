"""``make demo``: serve SmolLM2 with the TaSQ KV cache on this machine and ask it two things.

``python -m sglang_tasq.demo [--artifact DIR] [--port N] [--log FILE]``:

1. materializes the model (:func:`models.resolve_model`);
2. calibrates once if no artifact is cached (``python -m calibrate --model smollm2-135m
   --out artifacts/smollm2``, the default preset: ~6 min on 2 idle cores);
3. launches ``python -m sglang.launch_server ... --tasq-config A --attention-backend tasq``
   on 127.0.0.1, sends a chat request and a needle-in-a-haystack request through the
   OpenAI-compatible API, prints the answers and the KV pool capacity (tokens) against bf16
   in the same memory, and shuts the server down.

The server's output goes to a log file (``--log``, default ``~/.cache/sglang-tasq/logs/
demo-server.log``) whose path the demo prints, so the console shows only ``[demo]`` lines; if
the server exits early the demo prints the log's last lines and exits 1.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .options import child_env
from .models import resolve_model
from .paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARTIFACT = ROOT / "artifacts" / "smollm2"
NEEDLE = "The secret passcode is 7421."


def ensure_artifact(out: Path, model_dir: Path) -> Path:
    manifest = out / "tasq.json"
    if manifest.is_file():
        return manifest
    print(f"[demo] calibrating SmolLM2 (default preset) -> {out} (once, ~6 min)", flush=True)
    subprocess.run([sys.executable, "-m", "calibrate", "--model", "smollm2-135m", "--out", str(out)],
                   check=True, cwd=str(ROOT))
    return manifest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc, timeout: float = 600) -> None:
    """Wait until the server answers both its HTTP front end (``/v1/models``) and its scheduler
    (``/get_server_info`` asks the scheduler for its state). The front end answers while the
    scheduler still runs SGLang's warm-up request, whose first forward compiles kernels (tens of
    seconds on a cold CPU cache): a caller that asked the scheduler then with a short timeout
    failed on a slow host."""
    t0 = time.time()
    while (left := timeout - (time.time() - t0)) > 0:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        try:
            _get(base + "/v1/models", timeout=5)
            _get(base + "/get_server_info", timeout=max(1.0, min(60.0, left)))
            return
        except OSError:  # refused, reset or timed out (socket timeouts are OSErrors)
            time.sleep(2)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_server(proc, timeout: float = 60) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM to the launcher alone,
    SGLang's graceful path (it drains, sends its scheduler a shutdown request, waits for it and
    exits). A signal to the whole process group instead kills the scheduler under the launcher,
    whose watchdog then reports "Subprocess scheduler_0 crashed ... SIGQUIT". Whatever of the
    group is still alive after ``timeout`` s (or after a launcher that had already exited) gets
    SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    t0 = time.time()  # the launcher's children leave on their own within seconds of it
    while _group_alive(proc.pid) and time.time() - t0 < 10:
        time.sleep(0.2)
    if _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=timeout)


def log_tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log file (what to show when a server fails)."""
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def chat(base: str, model: str, text: str, max_tokens: int = 48) -> str:
    r = _post(base + "/v1/chat/completions", {"model": model, "temperature": 0, "max_tokens": max_tokens,
                                              "messages": [{"role": "user", "content": text}]})
    return r["choices"][0]["message"]["content"].strip()


def haystack(n_sentences: int = 60) -> str:
    filler = [f"Note {i}: the weather in town {i} was mild and the market opened on time." for i in range(n_sentences)]
    filler.insert(n_sentences // 3, NEEDLE)
    return " ".join(filler) + "\n\nWhat is the secret passcode? Answer with the number only."


def capacity(info: dict, art_path: Path) -> str:
    from .artifact import load_artifact
    from .packing import bytes_per_token

    art = load_artifact(art_path)
    fp = art.model
    states = (info.get("internal_states") or [{}])[0]
    tokens = info.get("max_total_num_tokens") or states.get("max_total_num_tokens")
    kv_gb = (states.get("memory_usage") or {}).get("kvcache")
    tasq_b = bytes_per_token(art.config, fp.num_kv_heads, fp.head_dim, fp.num_layers)
    bf16_b = 2 * fp.num_kv_heads * fp.head_dim * 2 * fp.num_layers
    lines = [f"[demo] KV bytes/token over {fp.num_layers} layers: TaSQ {tasq_b} vs bf16 {bf16_b} "
             f"({bf16_b / tasq_b:.2f}x, codes + scale)"]
    if tokens and kv_gb:
        bf16_tokens = int(kv_gb * 2**30 // bf16_b)
        lines.append(f"[demo] pool capacity: TaSQ {tokens} tokens in {kv_gb:.3f} GB (windows included) vs bf16 "
                     f"{bf16_tokens} tokens in the same memory ({tokens / max(bf16_tokens, 1):.2f}x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_tasq.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--mem-fraction-static", type=float, default=0.1)
    ap.add_argument("--log", type=Path, default=None, help="server log file (default: CACHE/logs/demo-server.log)")
    a = ap.parse_args(argv)
    model_dir = resolve_model("smollm2-135m")
    manifest = ensure_artifact(a.artifact, model_dir)
    port = a.port or _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--tasq-config", str(manifest),
           "--device", "cpu", "--attention-backend", "tasq", "--disable-cuda-graph", "--host", "127.0.0.1",
           "--port", str(port), "--mem-fraction-static", str(a.mem_fraction_static), "--max-running-requests", "16"]
    env = child_env()  # the store is sized from --max-running-requests 16
    log_path = a.log or cache_dir("logs") / "demo-server.log"
    print("[demo] " + " ".join(cmd), flush=True)
    print(f"[demo] server log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        try:
            wait_ready(base, proc)
        except (RuntimeError, TimeoutError) as e:
            print(f"[demo] server failed: {e}; last lines of {log_path}:\n{log_tail(log_path)}", flush=True)
            return 1
        name = str(model_dir)
        print(f"[demo] chat  > What is the capital of France?\n[demo] chat  < {chat(base, name, 'What is the capital of France?')}")
        answer = chat(base, name, haystack(), max_tokens=16)
        code = NEEDLE.rstrip(".").split()[-1]
        print(f"[demo] needle ({NEEDLE!r} hidden in ~{len(haystack().split())} words) < {answer} "
              f"({'found' if code in answer else 'missed'})")
        print(capacity(_get(base + "/get_server_info"), manifest), flush=True)
    finally:
        stop_server(proc)
        print("[demo] server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
