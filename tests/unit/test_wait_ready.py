"""``demo.wait_ready``: a server counts as ready only once its scheduler answers, not when its
HTTP front end does. SGLang's front end answers ``/v1/models`` while the scheduler still runs the
warm-up request (whose first forward compiles kernels on a cold cache); a caller that then asked
``/get_server_info`` with a 10 s timeout failed CI on a slow host. A real local HTTP server plays
such a server: ``/v1/models`` at once, ``/get_server_info`` stalling past the first poll."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_tasq.demo import wait_ready


def _server(info_ready_at: float, stall: float):
    calls = []

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            calls.append((self.path, time.time()))
            if self.path == "/get_server_info" and time.time() < info_ready_at:
                time.sleep(stall)  # the scheduler is busy with a forward
                if time.time() < info_ready_at:
                    return self.send_error(503)
            body = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, calls


def test_ready_only_when_the_scheduler_answers():
    srv, calls = _server(info_ready_at=time.time() + 3.0, stall=1.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.time()
        wait_ready(f"http://127.0.0.1:{srv.server_address[1]}", proc, timeout=30)
        assert time.time() - t0 >= 2.5  # not at the front end's first answer
        assert calls[-1][0] == "/get_server_info"
        assert calls[0][0] == "/v1/models"
    finally:
        proc.kill()
        srv.shutdown()


def test_a_server_that_exits_is_reported_not_waited_for():
    srv, _ = _server(info_ready_at=time.time() + 3600, stall=0.1)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(RuntimeError, match="status 3"):
            wait_ready(f"http://127.0.0.1:{srv.server_address[1]}", proc, timeout=30)
    finally:
        srv.shutdown()


def test_a_scheduler_that_never_answers_times_out():
    srv, _ = _server(info_ready_at=time.time() + 3600, stall=0.2)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(TimeoutError, match="not ready after 3 s"):
            wait_ready(f"http://127.0.0.1:{srv.server_address[1]}", proc, timeout=3)
    finally:
        proc.kill()
        srv.shutdown()
