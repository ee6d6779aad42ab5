"""bench.parallel's logic: server specs and the report (the servers themselves run in the bench)."""
import argparse

import pytest

from bench import parallel as P


def test_server_specs():
    assert P.parse_server("tasq@tp3") == ("tasq", "tp", 3) and P.parse_server("bf16@dp2") == ("bf16", "dp", 2)
    for bad in ("tasq", "fp8@tp2", "tasq@pp2", "tasq@tp0", "tasq@tpx"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected bf16|tasq"):
            P.parse_server(bad)


def test_report_compares_each_degree_with_its_kind_at_one():
    ok = lambda answers, lps: {"status": "ok", "startup_s": 1.0, "answers": answers, "prompt_logprobs": lps}  # noqa: E731
    res = {"hardware": {"cpu": "x"}, "artifact": "a", "new_tokens": 4, "servers": {
        "bf16@tp1": ok(["a", "b"], [[-1.0, -2.0]]), "bf16@tp3": ok(["a", "c"], [[-1.5, -2.0]]),
        "tasq@tp1": ok(["a", "b"], [[-1.0, -2.0]]), "tasq@tp3": ok(["a", "b"], [[-1.0, -2.25]]),
        "tasq@dp2": {"status": "failed", "reason": "boom"}}}
    md = P.report(res)
    assert "| tasq@tp3 | tasq@tp1 | 2/2 | 0.250 | 0.500 |" in md
    assert "| bf16@tp3 | bf16@tp1 | 1/2 | 0.500 | 0.500 |" in md
    assert "| tasq@dp2 | | failed: boom" in md and "| tasq@tp1 | (reference) |" in md
