"""Backend, tokenizer and LoRA set-up.

Importing this package loads a fast BLAS for MLX on Linux (see :mod:`base_setup.backend`) before
anything imports ``mlx.core``; every other package of the project imports it first for that reason.
"""

from base_setup.backend import BlasInfo, blas_info, seed_everything, setup_blas

setup_blas()

__all__ = ["BlasInfo", "blas_info", "seed_everything", "setup_blas"]
