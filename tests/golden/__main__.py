"""``python -m tests.golden record|check [runs]`` (see :mod:`tests.golden.runs`)."""

import os

os.environ.setdefault("PPO_MLX_BLAS", "cmeel")  # the suite's BLAS (tests/conftest.py)

from base_setup import setup_blas  # noqa: E402

setup_blas()  # before any import of mlx

import sys  # noqa: E402

from tests.golden.runs import main  # noqa: E402

sys.exit(main())
