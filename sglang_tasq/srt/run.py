"""Run an SGLang module with the TaSQ plugin loaded first, so its parser accepts --tasq-config.

``python -m sglang_tasq.srt.run MODULE [ARGS...]``, e.g.::

    python -m sglang_tasq.srt.run sglang.benchmark.one_batch --model-path M --device cpu \\
        --tasq-config artifacts/smollm2/tasq.json --batch-size 4 --input-len 256 --output-len 32
    python -m sglang_tasq.srt.run offline_throughput --model-path M --tasq-config A ...

``one_batch`` / ``offline_throughput`` build their parsers before SGLang loads plugins; here the
plugins load first, ``--tasq-config PATH`` is taken out of argv and exported as
``SGLANG_TASQ_CONFIG`` (every spawned process inherits it), and ``--attention-backend tasq`` is
added when no backend is given. Short names resolve to ``sglang.benchmark.<name>``. Without
``--tasq-config`` the module runs exactly as ``python -m MODULE``.
"""
from __future__ import annotations

import runpy
import sys

from ..options import export_config_path
from . import launch

SHORT = {"one_batch", "offline_throughput", "one_batch_server", "serving"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    module, rest = argv[0], argv[1:]
    if module in SHORT:
        module = f"sglang.benchmark.{module}"
    from sglang.srt.plugins import load_plugins

    from .plugin import split_tasq_flag

    rest, path = split_tasq_flag(rest)
    if path is not None:
        export_config_path(path)
        if not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in rest):
            rest += ["--attention-backend", launch.BACKEND_NAME]
    load_plugins()
    sys.argv = [module] + rest
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except launch.TaSQLaunchError as e:
        launch.refuse(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
