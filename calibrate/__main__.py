import sys

from sglang_tasq.options import passive_omp  # noqa: E402

passive_omp()  # before torch starts OpenMP

from .cli import main  # noqa: E402

sys.exit(main())
