"""The README's "Use it from transformers" block runs as written (on the serving artifact it names,
made here from the session's calibrated artifact by the README's own `calibrate serving` line)."""
import ast
import re
import subprocess
import sys

import pytest

from _support import ROOT

SECTION = "## Use it from `transformers`"


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README lost its section {SECTION!r}"
    m = re.search(r"```python\n(.*?)```", text[text.index(SECTION):], re.S)
    assert m, f"no python block under {SECTION!r}"
    return m.group(1)


def test_block_names_the_serving_artifact_of_calibrate():
    block = readme_block()
    assert '"artifacts/smollm2_salient4"' in block
    assert "--out artifacts/smollm2_salient4 --salient 36/192@17 --exact res4" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_block_runs(artifact, tmp_path):
    out = tmp_path / "smollm2_salient4"
    subprocess.run([sys.executable, "-m", "calibrate", "serving", str(artifact), "--out", str(out),
                    "--salient", "36/192@17", "--exact", "res4"], check=True, capture_output=True, cwd=ROOT)
    script = tmp_path / "block.py"
    script.write_text(readme_block().replace('"artifacts/smollm2_salient4"', repr(str(out))))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert "Paris" in lines[0]
    kinds = ast.literal_eval(lines[1])  # the printed dict of stored bytes by kind
    assert kinds["codes"] > 0 and kinds["window"] > 0 and "echo" in kinds
