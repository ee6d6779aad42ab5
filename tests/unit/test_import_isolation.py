"""The pure modules import without SGLang and transformers: every top-level module of
``sglang_tasq`` (the subpackages ``srt``, the SGLang side, and ``hf``, the transformers side,
excluded) and every module of ``numba_kernels`` (its ``cpu`` package included).

One child process imports them all with ``sglang`` and ``transformers`` made unimportable, as if
not installed: ``sys.modules[name] = None`` makes ``import name`` (and ``import name.sub``) raise
ModuleNotFoundError and ``importlib.util.find_spec(name)`` answer None. The child runs the venv's
interpreter as it is, site and ``.pth`` files included: the SGLang import shims
(``sglang_tasq.srt._compat_shims``, imported at start-up by a ``.pth`` line) act in every real
process, and the child first checks that they imported neither package.

Left out: ``numba_kernels.sim_cases``, a test driver that switches the CUDA simulator on when
imported (``NUMBA_ENABLE_CUDASIM=1``).
"""
from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys

import pytest

from _support import ROOT

BLOCKED = ("sglang", "transformers")
SIDE_EFFECT_ON_IMPORT = {"numba_kernels.sim_cases"}


def _modules() -> list[str]:
    """Module names from the source tree (found, not imported)."""
    tasq = importlib.util.find_spec("sglang_tasq").submodule_search_locations
    names = [f"sglang_tasq.{m.name}" for m in pkgutil.iter_modules(tasq) if not m.ispkg]
    names += [n for n in _walk("numba_kernels") if n not in SIDE_EFFECT_ON_IMPORT]
    return sorted(names)


def _walk(package: str) -> list[str]:
    spec = importlib.util.find_spec(package)
    out = [package]
    for m in pkgutil.iter_modules(spec.submodule_search_locations):
        out += _walk(f"{package}.{m.name}") if m.ispkg else [f"{package}.{m.name}"]
    return out


MODULES = _modules()

CHILD = r"""
import importlib, json, sys, traceback
blocked, modules = json.loads(sys.argv[1])
early = [b for b in blocked if b in sys.modules]  # imported at start-up (site, .pth shims)
for b in blocked:
    sys.modules[b] = None  # not installed: import raises ModuleNotFoundError
errors = {}
for name in modules:
    try:
        importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 (report every module)
        errors[name] = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-4))
print(json.dumps({"early": early, "errors": errors,
                  "still_blocked": all(sys.modules.get(b, 0) is None for b in blocked)}))
"""


@pytest.fixture(scope="module")
def child():
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps([BLOCKED, MODULES])], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1])


def test_the_module_list_covers_both_packages():
    assert {"sglang_tasq.codec", "sglang_tasq.windows", "sglang_tasq.options"} <= set(MODULES)
    assert {"numba_kernels.ops", "numba_kernels.fastpath", "numba_kernels.cpu"} <= set(MODULES)
    assert not [m for m in MODULES if m.startswith(("sglang_tasq.srt", "sglang_tasq.hf"))]


def test_start_up_imports_neither_package(child):
    """Nothing the interpreter runs at start-up (the shims' .pth line) imports SGLang or
    transformers, and nothing undid the block."""
    assert child["early"] == [] and child["still_blocked"], child


@pytest.mark.parametrize("module", MODULES)
def test_imports_without_sglang_and_transformers(child, module):
    assert module not in child["errors"], child["errors"][module]
