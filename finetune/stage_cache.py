"""A pipeline stage (SFT, reward model) whose output is reused by the next run with the same
settings: the demo's stages and the examples' SFT of the embedded tiny model.

A stage that completes writes a stamp (its settings and the model directory it produced) into its
folder; :func:`cached_stage` returns that directory instead of running the stage again while the
stamp's settings equal the new ones, and says so. A stage killed midway writes no stamp, so it
runs again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

STAMP = "stage.json"
"""The stamp's file name in a stage folder, written after the stage's model."""


def cached_result(stage_dir: Path, settings: Mapping[str, Any]) -> Path | None:
    """The model directory of the stage completed in ``stage_dir`` with these ``settings`` (JSON
    values), or None when there is none (no stamp, other settings, or the model is gone)."""
    stamp = stage_dir / STAMP
    if not stamp.is_file():
        return None
    recorded = json.loads(stamp.read_text())
    model = Path(recorded["model"])
    if recorded.get("settings") != json.loads(json.dumps(settings)) or not model.is_dir():
        return None
    return model


def cached_stage(
    name: str,
    stage_dir: Path,
    settings: Mapping[str, Any],
    run: Callable[[], str | Path],
    *,
    fresh: bool = False,
) -> Path:
    """The model directory of stage ``name``: the cached one (:func:`cached_result`) unless
    ``fresh``, else ``run()``'s, stamped into ``stage_dir`` for the next run. Prints which.

    ``settings`` must hold everything the result depends on (the starting model, the data or a
    digest of it, the hyperparameters).
    """
    cached = None if fresh else cached_result(stage_dir, settings)
    if cached is not None:
        print(f"[{name}] reusing the cached result in {cached} (--fresh to rebuild)")
        return cached
    start = time.perf_counter()
    model = Path(run())
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / STAMP).write_text(json.dumps({"settings": settings, "model": str(model)}))
    print(f"[{name}] done in {time.perf_counter() - start:.0f} s -> {model}")
    return model
