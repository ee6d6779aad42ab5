import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

from .cli import main  # noqa: E402

sys.exit(main())
