"""Shared test set-up. Importing base_setup first gives MLX its fast BLAS in the test process."""

import base_setup  # noqa: F401  (must precede every mlx import)
