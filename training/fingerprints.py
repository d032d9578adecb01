"""Fingerprints of what a run reads besides its settings: the weights it starts from, its data,
its reward. A checkpoint records them (``inputs`` in its state); a resume whose inputs differ is
refused, naming each change (:func:`check_same_inputs`), as a changed setting is.

A model folder's fingerprint reads a bounded amount whatever its size: every ``.json`` file
whole (config, tokenizer, index), and for each weights file its size, its safetensors header
(names, dtypes, shapes, offsets) and :data:`SAMPLES` blocks spread evenly over its data. A
retrained model (every weight moves) or another model at the same path changes it; an edit of a
few bytes between the sampled blocks would not. A name that is not a local folder (a Hugging
Face repository, content-addressed by its revision) has no fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

#: Blocks of :data:`BLOCK` bytes read from each weights file.
SAMPLES = 64
BLOCK = 4096


def _weights_digest(path: Path, digest: Any) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            digest.update(f.read(min(struct.unpack("<Q", head)[0], size)))
        for k in range(SAMPLES):
            f.seek(max(size - BLOCK, 0) * k // max(SAMPLES - 1, 1))
            digest.update(f.read(BLOCK))


def model_fingerprint(name_or_path: str | Path | None) -> str | None:
    """The fingerprint of the model folder ``name_or_path`` (see the module docstring), or None
    when it is not a local folder."""
    if name_or_path is None or not Path(name_or_path).is_dir():
        return None
    folder = Path(name_or_path)
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = str(path.relative_to(folder))
        if path.suffix == ".json":
            digest.update(relative.encode())
            digest.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".npz", ".bin", ".gguf"):
            digest.update(relative.encode())
            _weights_digest(path, digest)
    return f"sha256 {digest.hexdigest()[:16]}"


def _plain(value: Any) -> Any:
    """A JSON stand-in for what ``json`` cannot write: arrays as lists, dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return repr(value)


def data_fingerprint(records: Sequence[Any]) -> str:
    """``"<n> records, sha256 <hash>"`` of ``records`` (prompts, data records) as JSON."""
    text = json.dumps(list(records), sort_keys=True, default=_plain)
    return f"{len(records)} records, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def source_fingerprint(functions: Sequence[Callable[..., Any]]) -> str | None:
    """``"<file>:<name> sha256 <hash>"`` of the source code of each of ``functions`` (a
    ``functools.partial`` unwrapped), joined by ``", "``; None when none has source code (a
    builtin, a function typed at a prompt). An edit of a function's body changes it; one
    elsewhere in its file (another function, a constant it reads) does not, so that editing
    the script around a reward does not refuse a resume."""
    found: dict[str, str] = {}
    for fn in functions:
        while isinstance(fn, functools.partial):
            fn = fn.func
        try:
            path, code = inspect.getsourcefile(fn), inspect.getsource(fn)
        except (TypeError, OSError):  # a builtin, or no source file to read
            continue
        name = f"{Path(path or '?').name}:{getattr(fn, '__qualname__', '?')}"
        found[name] = f"{name} sha256 {hashlib.sha256(code.encode()).hexdigest()[:16]}"
    return ", ".join(found.values()) or None


#: What each recorded input is, for messages.
_LABELS = {
    "model": "the base model (model_name)",
    "ref_model": "the reference model (sft_model_name)",
    "ref_model_name": "the reference model (ref_model_name)",
    "value_model": "the value model (value_model_name)",
    "reward": "the reward",
    "reward_source": "the reward's source",
    "environment": "the environment factory (environment_factory=)",
    "tools": "the tools (tools=)",
    "prompts": "the prompts",
    "data": "the training data",
    "eval_data": "the held-out data",
}


def check_same_inputs(
    path: str | Path, saved: Mapping[str, Any] | None, current: Mapping[str, Any]
) -> None:
    """Raise ``ValueError`` naming every input that differs between the checkpoint at ``path``
    (its recorded ``saved`` inputs) and this run (``current``). An input either side did not
    record (an older checkpoint, a model given as an object) is not compared."""
    saved = saved or {}
    changed = [
        f"{_LABELS.get(key, key)}: {saved[key]} -> {value}"
        for key, value in current.items()
        if value is not None and saved.get(key) is not None and saved[key] != value
    ]
    if changed:
        raise ValueError(
            f"checkpoint {path} was trained on other inputs than this run's: "
            + "; ".join(changed)
            + ". Resume with the inputs the run started with, or start a new run (another "
            "output_dir, or --overwrite)"
        )
