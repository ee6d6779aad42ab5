"""The SGLang side of TaSQ: the only package that imports SGLang.

``plugin`` (the ``sglang.srt.plugins`` entry point: hooks, ``--tasq-config``), ``launch``
(artifact and server-argument checks before serving), ``pool`` (the compressed token-to-KV
pool), ``backend`` (the attention backend; CPU kernels or plain torch), ``serve_cuda`` (its CUDA
path over the Numba kernels), ``run`` (SGLang's offline benches with the flag), ``_compat_shims``
(CPU-only torch packaging fixes). Importing this package imports nothing of SGLang.
"""
