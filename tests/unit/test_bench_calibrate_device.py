"""``bench.calibrate_device``: the Llama-3.1-8B shape is that model's, and the whole run (random
checkpoint -> ``python -m calibrate`` in a subprocess -> artifact read back) works on a CPU at the
tiny shape, as it will on a GPU at the 8B one."""
import json

import pytest
import torch

from bench import calibrate_device as cd


def test_llama_8b_shape_has_llama_3_1_8b_parameter_count():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cd.SHAPES["llama-3.1-8b"]))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3.1-8B's count
    attn = model.model.layers[0].self_attn
    assert (attn.k_proj.out_features, attn.q_proj.out_features) == (8 * 128, 32 * 128)
    assert model.model.rotary_emb.rope_type == "llama3"


def test_unknown_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--shape 'llama-70b': allowed"):
        cd.build_checkpoint("llama-70b", tmp_path / "x", tmp_path, "cpu")


@pytest.mark.slow  # calibrates (a tiny model, ~40 s)
def test_tiny_shape_end_to_end_on_cpu(tmp_path, smollm2_dir):
    work = tmp_path / "work"
    assert cd.main(["--shape", "tiny", "--device", "cpu", "--preset", "fast", "--tokens", "4096",
                    "--fisher-tokens", "2048", "--results", str(tmp_path / "res"), "--work", str(work)]) == 0
    run = tmp_path / "res" / "tiny_fast_cpu"
    m = json.loads((run / "metrics.json").read_text())
    cal = m["calibration"]
    assert (cal["tokens"], cal["fisher_tokens"]) == (4096, 2048)  # the passed-on calibrate flags took
    assert cal["kmeans"]["device"] == "cpu" and m["extra_flags"] == ["--tokens", "4096", "--fisher-tokens", "2048"]
    assert {"capture", "kmeans", "evaluate", "total"} <= set(cal["stage_times_s"])
    assert m["wall_s"] >= cal["stage_times_s"]["total"] > 0  # timed from outside the process
    assert m["params"] > 1e6
    assert "calibration wall time" in (run / "summary.md").read_text()
    assert m["calibration"]["heldout"]["tokens"] > 0  # read back from the artifact, checked against the model
    assert not (work / "tiny-random").exists() and not (work / "artifact").exists()  # scratch unless --keep
