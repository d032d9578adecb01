"""reward kl stage of the PPO data flow."""

import base_setup  # noqa: F401  (loads a fast BLAS before mlx is first imported)
