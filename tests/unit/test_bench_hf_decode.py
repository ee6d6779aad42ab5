"""bench.hf_decode: medians and ratios against DynamicCache, bad flags refused, one real run."""
import json

import pytest

from bench import hf_decode


def _run(prefill, decode, tokens, bpt=None):
    return {"prefill_s": prefill, "decode_ms": decode, "tokens": tokens, "bytes_per_token": bpt}


def test_summarize_medians_ratios_and_tokens():
    runs = {"bf16": [_run(1.0, 10.0, [1, 2]), _run(3.0, 30.0, [1, 2]), _run(2.0, 20.0, [1, 2])],
            "tasq": [_run(4.0, 50.0, [1, 3], 1868.0), _run(2.0, 30.0, [1, 3], 1868.0), _run(3.0, 40.0, [1, 3], 1868.0)]}
    s = hf_decode.summarize(runs, bf16_bytes=23040)
    assert s["bf16"]["prefill_s"] == 2.0 and s["bf16"]["decode_ms"] == 20.0
    assert s["bf16"]["decode_vs_bf16"] == 1.0 and s["bf16"]["bytes_per_token"] == 23040
    assert s["tasq"]["prefill_vs_bf16"] == pytest.approx(1.5) and s["tasq"]["decode_vs_bf16"] == pytest.approx(2.0)
    assert s["tasq"]["bytes_per_token"] == 1868.0
    assert s["bf16"]["same_tokens_as_bf16"] and not s["tasq"]["same_tokens_as_bf16"]
    assert len(s["tasq"]["rounds"]) == 3
    md = hf_decode.markdown(s, {"model": "m", "prompt_tokens": 8, "new_tokens": 2, "rounds": 3, "torch_threads": 1,
                                "model_dtype": "bfloat16", "hardware": {"cpu": "x", "cores": 2}})
    assert "| tasq | 3.00 | 1.50x | 40.0 | 2.00x | 1,868 | no |" in md


@pytest.mark.parametrize("argv,msg", [(["--artifact", "bf16=x"], "must differ"),
                                      (["--artifact", "kivi2=x"], "must differ"),
                                      (["--rounds", "0"], ">= 1"), (["--artifact", "noequals"], "expected NAME=DIR")])
def test_bad_flags_exit_2(argv, msg, capsys):
    assert hf_decode.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench.hf_decode:") and msg in err


@pytest.mark.slow
def test_real_model_short_run(artifact, tmp_path):
    """Every token inside the 64 + 256 windows: each cache attends to exact copies, so its greedy
    tokens are bf16's (a cache that corrupts what it holds in its windows fails here)."""
    assert hf_decode.main(["--prompt-tokens", "96", "--new-tokens", "3", "--rounds", "1", "--threads", "2",
                           "--artifact", f"tasq={artifact.parent}", "--results", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "smollm2-135m_p96_n3" / "hf_decode.json").read_text())
    caches = out["caches"]
    assert list(caches) == ["bf16", "fp8_e4m3", "kivi2", "tasq"]
    assert caches["bf16"]["decode_vs_bf16"] == 1.0 and caches["bf16"]["bytes_per_token"] == 23040
    assert all(c["same_tokens_as_bf16"] for c in caches.values())
    assert all(c["prefill_s"] > 0 and c["decode_ms"] > 0 for c in caches.values())
    assert (tmp_path / "smollm2-135m_p96_n3" / "hf_decode.md").is_file()
