"""A real ``sglang.launch_server`` (CPU, bf16, no ``--tasq-config``: the plugin is loaded but
TaSQ is inactive) answers bad requests with 4xx and stays up.

SGLang 0.5.23 schedules an empty prompt (``{"text": ""}`` tokenizes to 0 tokens) as a 0-token
prefill; the rotary embedding raises in the scheduler and the whole server exits. The plugin
refuses it in ``TokenizerManager._validate_one_request`` (HTTP 400), which this module checks
along with SGLang's own refusals (negative max_new_tokens, over-long input, bad JSON, negative
or NaN temperature), then that the server still answers a normal request. One server for the
module.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _support import ROOT
from sglang_tasq.options import child_env
from sglang_tasq.demo import _free_port, stop_server, wait_ready
from sglang_tasq.srt.plugin import EMPTY_PROMPT_MESSAGE

NORMAL = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


class Server:
    def __init__(self, base: str, proc: subprocess.Popen, log: Path):
        self.base, self.proc, self.log = base, proc, log

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def post(self, path: str, body=None, raw: bytes | None = None, timeout: float = 120) -> tuple[int, str]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except OSError as e:  # connection reset/refused: the server went down
            pytest.fail(f"POST {path} {data[:120]!r}: no HTTP answer ({e!r}); server alive: "
                        f"{self.proc.poll() is None}\n--- server log tail ---\n{self.log_tail()}")

    def assert_up(self) -> None:
        assert self.proc.poll() is None, f"server exited ({self.proc.returncode})\n{self.log_tail()}"
        status, body = self.post("/generate", NORMAL)
        assert status == 200, (status, body)
        out = json.loads(body)
        assert out["meta_info"]["completion_tokens"] >= 1, out


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(smollm2_dir), "--device", "cpu",
           "--disable-cuda-graph", "--attention-backend", "torch_native", "--mem-fraction-static", "0.05",
           "--host", "127.0.0.1", "--port", str(port)]
    env = child_env()
    env.pop("SGLANG_TASQ_CONFIG", None)  # bf16: the guard must not depend on TaSQ being active
    env.pop("SGLANG_PLUGINS", None)  # a whitelist could leave the plugin out
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        try:
            wait_ready(srv.base, proc, timeout=360)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"server did not start: {e}\n{srv.log_tail()}")
        yield srv
    finally:
        stop_server(proc)


def _assert_4xx(status: int, body: str, needle: str | None = None) -> None:
    assert 400 <= status < 500, (status, body[:500])
    if needle is not None:
        assert needle.lower() in body.lower(), body[:500]


# pytest runs these in file order: the empty prompts, a normal request, the other bad requests,
# then the liveness checks.
@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"input_ids": []}, "empty"),
    ("/generate", {"input_ids": [[]]}, "empty"),          # a batch of one empty prompt
    ("/generate", {"text": ["", "Hi"], "sampling_params": {"max_new_tokens": 1}}, "empty"),
    ("/v1/completions", {"model": "m", "prompt": ""}, "empty"),
    ("/v1/completions", {"model": "m", "prompt": ["", "Hi"], "max_tokens": 1}, "empty"),
], ids=["text", "input_ids", "input_ids-batch", "text-batch", "completions", "completions-batch"])
def test_empty_prompt_is_4xx(server, path, body, needle):
    status, text = server.post(path, body)
    _assert_4xx(status, text, needle)
    assert server.proc.poll() is None, server.log_tail()


def test_empty_prompt_message_is_ours(server):
    status, text = server.post("/generate", {"text": ""})
    assert status == 400, (status, text)
    assert json.loads(text)["error"]["message"] == EMPTY_PROMPT_MESSAGE


def test_normal_request_after_empty_prompts(server):
    server.assert_up()


@pytest.mark.parametrize("path,body,raw", [
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, None),
    ("/generate", {"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 1}}, None),  # > 8192 context
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100000}}, None),
    ("/generate", None, b'{"text": "Hi", "sampling_params": '),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}}, None),
    ("/generate", None, b'{"text": "Hi", "sampling_params": {"temperature": NaN}}'),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": "NaN"}}, None),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": -1}, None),
    ("/v1/completions", None, b'{"model": "m", "prompt": '),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "temperature": -1}, None),
    ("/v1/completions", None, b'{"model": "m", "prompt": "Hi", "temperature": NaN}'),
], ids=["neg-max-new", "too-long-input", "too-long-total", "bad-json", "neg-temp", "nan-temp",
        "nan-temp-str", "oai-neg-max", "oai-bad-json", "oai-neg-temp", "oai-nan-temp"])
def test_other_bad_requests_are_4xx(server, path, body, raw):
    status, text = server.post(path, body, raw=raw)
    _assert_4xx(status, text)
    assert server.proc.poll() is None, server.log_tail()


def test_server_still_answers(server, smollm2_dir):
    server.assert_up()
    status, text = server.post("/v1/completions", {"model": str(smollm2_dir), "prompt": "The capital of France is",
                                                   "max_tokens": 4, "temperature": 0})
    assert status == 200, (status, text)
    assert json.loads(text)["choices"][0]["text"]
