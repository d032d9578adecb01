"""Backend, tokenizer and LoRA set-up.

Importing this package has no side effect (it does not import mlx). An entry point calls
:func:`setup_blas` first thing, before anything imports ``mlx.core``, to give MLX a fast BLAS on
Linux (see :mod:`base_setup.backend`).
"""

from base_setup.backend import BlasInfo, blas_info, seed_everything, setup_blas

__all__ = ["BlasInfo", "blas_info", "seed_everything", "setup_blas"]
