"""Memory of policy + reference model: a separate frozen copy vs. the policy's base with LoRA off
vs. no reference at all (a run without a KL term: GRPO's ``beta: 0``).

Usage::

    python -m benchmarks.reference_memory            # demo-size model and a ~20M-parameter one
    python -m benchmarks.reference_memory --sizes demo

For each model size it builds a tiny qwen3 checkpoint (:mod:`fixtures.tiny_model`), then runs one
subprocess per mode, so each peak is measured alone:

* ``copy``: ``PolicyModel`` with LoRA + ``ReferenceModel.from_pretrained`` (two sets of weights);
* ``shared``: ``PolicyModel`` with LoRA + ``ReferenceModel.from_policy`` (one set, adapters off);
* ``none``: ``PolicyModel`` with LoRA alone (no KL term, so no reference and no reference pass).

Each subprocess loads both models, runs one forward pass of each on a (4, 64) batch and reports
MLX's allocator figures (``mx.get_active_memory`` after loading, ``mx.get_peak_memory`` over the
whole run, after ``mx.reset_peak_memory``); these count MLX arrays on every backend, the CPU one
included.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import cast

from fixtures.tiny_model import TINY_SIZES, TinyModelSpec, build_checkpoint

#: About 19.5M parameters (78 MB in float32).
SPEC_20M = TinyModelSpec(
    vocab_size=1024,
    hidden_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1536,
)
SPECS: dict[str, TinyModelSpec] = {"demo": TINY_SIZES["demo"], "20m": SPEC_20M}
MODES = ("copy", "shared", "none")


def _worker(mode: str, model_dir: str) -> dict[str, float]:
    """Load policy + reference in ``mode``, run one forward pass each, return memory figures."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from base_setup.lora_setup import LoraSettings
    from models.policy_model import PolicyModel
    from models.sft_model import ReferenceModel

    mx.random.seed(0)
    mx.reset_peak_memory()
    policy = PolicyModel.from_pretrained(model_dir, lora=LoraSettings(r=8, alpha=16.0, dropout=0.0))
    reference: ReferenceModel | None = None
    if mode == "copy":
        reference = ReferenceModel.from_pretrained(model_dir)
    elif mode == "shared":
        reference = ReferenceModel.from_policy(policy)
    elif mode != "none":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    mx.eval(policy.parameters(), [] if reference is None else reference.model.parameters())
    loaded = mx.get_active_memory()
    ids = mx.random.randint(0, policy.config["vocab_size"], (4, 64))  # (B, L)
    mx.eval(policy(ids), [] if reference is None else reference(ids))
    flat = cast(list[tuple[str, mx.array]], tree_flatten(policy.parameters()))
    n_params = sum(v.size for _, v in flat)
    return {
        "params_millions": n_params / 1e6,
        "active_after_load_mb": loaded / 2**20,
        "peak_mb": mx.get_peak_memory() / 2**20,
    }


def _run_mode(mode: str, model_dir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.reference_memory", "--worker", mode, str(model_dir)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SPECS), default=["demo", "20m"])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(_worker(*args.worker)))
        return

    print(f"{'size':>5} {'params':>8} {'mode':>7} {'loaded MB':>10} {'peak MB':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = build_checkpoint(Path(tmp) / size, SPECS[size], seed=0)
            results = {mode: _run_mode(mode, model_dir) for mode in MODES}
            for mode, r in results.items():
                print(
                    f"{size:>5} {r['params_millions']:>7.2f}M {mode:>7} "
                    f"{r['active_after_load_mb']:>10.1f} {r['peak_mb']:>9.1f}"
                )
            ratio = results["shared"]["peak_mb"] / results["copy"]["peak_mb"]
            loaded_ratio = (
                results["shared"]["active_after_load_mb"] / results["copy"]["active_after_load_mb"]
            )
            print(f"{size:>5} shared/copy: peak {ratio:.2f}, loaded {loaded_ratio:.2f}")
            none = results["none"]["peak_mb"] / results["copy"]["peak_mb"]
            print(f"{size:>5} none/copy: peak {none:.2f}")


if __name__ == "__main__":
    main()
