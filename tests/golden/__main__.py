"""``python -m tests.golden record|check [runs]`` (see :mod:`tests.golden.runs`)."""

from base_setup import setup_blas

setup_blas()  # before any import of mlx

import sys  # noqa: E402

from tests.golden.runs import main  # noqa: E402

sys.exit(main())
