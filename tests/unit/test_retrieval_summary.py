"""bench.retrieval's summary on a machine that lacks another process's artifacts: the bits of a
point whose artifact is absent come from the folder's last summary.json (its fit was recorded in
artifacts.json when its items were made), never from a fresh calibration or a guess."""
import json

from bench import methods as M
from bench import retrieval as R


def test_recorded_bits_are_read_per_method(tmp_path):
    assert R.recorded_bits(tmp_path) == {}
    rows = [{"point": "tasq@g4k256/g8k1024:64+256:first", "bits_codes": [2.083, 1.25]},
            {"point": "tasq+tasq@g4k256/g8k1024@L17,18:64+256", "bits_codes": [1.383, 1.25]},
            {"point": "bf16", "bits_codes": [16.0, 16.0]}]
    (tmp_path / "summary.json").write_text(json.dumps(rows))
    assert R.recorded_bits(tmp_path) == {"tasq@g4k256/g8k1024": (2.083, 1.25),
                                         "tasq+tasq@g4k256/g8k1024@L17,18": (1.383, 1.25), "bf16": (16.0, 16.0)}


def test_artifacts_here_looks_for_every_artifact_a_point_reads(tmp_path):
    rate, mix = M.parse("tasq@g4k256/g8k1024"), M.parse("tasq+tasq@g4k256/g8k1024@L17,18")
    assert R.artifacts_here(M.parse("kivi2"), "default", tmp_path, {})  # closed form: reads none
    assert not R.artifacts_here(rate, "default", tmp_path, {})
    assert not R.artifacts_here(mix, "default", tmp_path, {})
    for spec in (rate, mix.base):
        d = M.artifact_dir(spec, tmp_path, "default")
        d.mkdir(parents=True, exist_ok=True)
        (d / "tasq.json").write_text("{}")
    assert R.artifacts_here(rate, "default", tmp_path, {})
    assert R.artifacts_here(mix, "default", tmp_path, {})  # base and hi both present
    assert not R.artifacts_here(mix, "fast", tmp_path, {})  # another preset's folder
    # --artifact NAME=DIR: the directory given, for a one-artifact mix too
    assert not R.artifacts_here(rate, "default", tmp_path, {rate.artifact_name: str(tmp_path / "elsewhere")})
    assert not R.artifacts_here(mix, "default", tmp_path, {mix.mixed_artifact_name: str(tmp_path / "elsewhere")})
