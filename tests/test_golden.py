"""The golden runs (tests/golden/runs.py) against their recordings in tests/data/golden: metrics
and weight updates within rtol 1e-5 (``python -m tests.golden check`` says whether they are equal
bit for bit; re-record with ``python -m tests.golden record``)."""

from __future__ import annotations

import pytest

from tests.golden.runs import RUNS, Models, compare, golden_path, read_golden, run_golden


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("golden"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_golden_run_matches_its_recording(name: str, golden_models: Models) -> None:
    comparison = compare(run_golden(name, golden_models), read_golden(name))
    assert not comparison.problems, (
        f"golden run {name} differs from tests/data/golden/{name}.json beyond rtol "
        "(python -m tests.golden check " + name + "):\n  " + "\n  ".join(comparison.problems)
    )


def test_every_golden_run_has_a_recording() -> None:
    missing = [name for name in RUNS if not golden_path(name).is_file()]
    assert not missing, f"record them: python -m tests.golden record {' '.join(missing)}"
