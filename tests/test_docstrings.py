"""The library's docstrings and comments say what and why, never how fast: a timing, a memory
peak or a speed-up goes stale with the next MLX release or machine, so figures live in
docs/performance.md and benchmarks/results/ (tests/ and benchmarks/ keep theirs)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [
    "config",
    "base_setup",
    "models",
    "fixtures",
    "token_attribution",
    "reward_kl",
    "advantage",
    "algorithms",
    "experience_buffer",
    "training",
    "finetune",
    "ppo_trainer",
    "sandbox",
    "agents",
    "examples",
]

# What a measurement looks like here: a duration ("16.3 s", "5.3 ms", "s/iter"), a decimal memory
# figure ("5.6 GB", "400 MB": settings and limits are written in binary units, MiB / GiB, or
# named by their constant), a rate ("GFLOP/s"), a speed ratio ("1.2x", "2x faster", "20% slower")
# or a date. Shapes ("16 x 128"), defaults ("1e-6") and counts do not match.
TIMING = re.compile(
    r"\b\d+(?:\.\d+)?(?: ?(?:ms|µs|us|ns)| s|s/iter| s/iter)\b"
    r"|\b\d+(?:\.\d+)? ?(?:GB|MB|KB)\b"
    r"|\b\d+(?:\.\d+)? ?[GT]FLOP"
    r"|\b\d+\.\d+x\b"
    r"|\b\d+(?:\.\d+)?(?:x|%) (?:faster|slower|as (?:fast|long)|the time)\b"
    r"|\b20\d\d-\d\d-\d\d\b"
)


def library_files() -> list[Path]:
    files = [p for folder in LIBRARY for p in sorted((ROOT / folder).rglob("*.py"))]
    return files + [ROOT / "main.py"]


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every docstring (module, class, function) and comment in ``path``."""
    source = path.read_text(encoding="utf-8")
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                found.append((node.body[0].lineno, text))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def timings(text: str) -> list[str]:
    return [m.group(0) for m in TIMING.finditer(" ".join(text.split()))]


@pytest.mark.parametrize(
    "text",
    [
        "took 16.3 s against 15.6 s",
        "3.5M elements in 5.3 ms",
        "50.7 s/iter",
        "peak 5.0 GB, against 2.9 GB",
        "400 MB in float32",
        "it measured 1.2x faster",
        "Horner's became two loops, 1.9x the time",
        "two streams made scoring 25% slower",
        "the run of 2026-11-24",
        "about 80 GFLOP/s",
    ],
)
def test_the_pattern_catches_a_timing(text: str) -> None:
    assert timings(text), text


@pytest.mark.parametrize(
    "text",
    [
        "(B, T, V) logits: 16 x 128 positions",
        "default 1e-6; tests check 1e-4",
        "the default shard size (5 GiB)",
        "returns 0s and 1s",
        "a clip of 0.2 (PPO's cliprange)",
        "timeout_s=5.0, memory_mb=512",
        "steps 1-3 of 10",
    ],
)
def test_the_pattern_leaves_values_alone(text: str) -> None:
    assert not timings(text), text


def test_no_library_docstring_or_comment_carries_a_timing() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {', '.join(hits)}"
        for path in library_files()
        for line, text in docstrings_and_comments(path)
        if (hits := timings(text))
    ]
    assert not found, (
        "timings in library docstrings or comments (put the figure in docs/performance.md and "
        "say why in words):\n" + "\n".join(found)
    )
