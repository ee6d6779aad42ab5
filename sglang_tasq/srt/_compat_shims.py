"""Two fixes to third-party packaging that let SGLang 0.5.23 import on a CPU-only torch.

Installed by ``scripts/setup.sh`` as a ``.pth`` line, so they act in every process of the
venv (SGLang spawns its schedulers). They cost nothing at start-up: an import hook acts only
when ``torchvision`` or SGLang's rotary module is first imported, and only when torch has no
CUDA. Neither replaces code of ours or SGLang's logic:

1. PyPI's torchvision 0.28 is a CUDA build; on CPU torch its import dies on
   ``operator torchvision::nms does not exist``. We declare the ``nms``/``qnms`` op schemas
   (no kernels: SGLang never calls them) before torchvision loads.
2. ``sglang.srt.layers.rotary_embedding.base`` stores ``vllm._custom_ops.rotary_embedding``
   as a fallback kernel on platforms it does not recognise; it is never called on CPU
   (``forward_native`` is used). We mark the module's platform as CPU so it skips the import.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_ROTARY = "sglang.srt.layers.rotary_embedding.base"
_done: set[str] = set()
_tv_lib = None


def _no_cuda() -> bool:
    if os.environ.get("TASQ_FORCE_SHIMS") == "1":
        return True
    import torch

    return not torch.cuda.is_available()


def _define_torchvision_schemas() -> None:
    global _tv_lib
    import torch

    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _tv_lib = lib  # keep the registration alive
    except RuntimeError:
        pass  # already defined by a real CPU build


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in ("torchvision", _ROTARY) or name in _done:
            return None
        _done.add(name)
        if not _no_cuda():
            return None
        if name == "torchvision":
            _define_torchvision_schemas()
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_mark_cpu(module):
            exec_module(module)
            module._is_cpu = True

        spec.loader.exec_module = exec_then_mark_cpu
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
