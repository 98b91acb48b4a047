"""The tier's comparison rules (``python -m pytest .ci/vllm_suite/test_compare.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import compare, entry_line, read_expected, regenerated

Records = dict[str, dict[str, str]]


def runs(**outcomes: tuple[str, str]) -> tuple[Records, Records]:
    off = {f"t.py::{k}": {"outcome": v[0], "message": "m"} for k, v in outcomes.items()}
    all_ = {f"t.py::{k}": {"outcome": v[1], "message": "m"} for k, v in outcomes.items()}
    return off, all_


def test_same_outcomes_need_no_entry() -> None:
    off, all_ = runs(a=("passed", "passed"), b=("failed", "failed"), c=("xfailed", "passed"))
    result = compare(off, all_, {}, complete=True)
    assert result.ok
    assert not result.differing


def test_a_new_failure_fails_unless_listed_with_a_reason() -> None:
    off, all_ = runs(a=("passed", "failed"), b=("passed", "error"))
    result = compare(off, all_, {}, complete=True)
    assert not result.ok
    assert result.unlisted == ["t.py::a", "t.py::b"]
    listed = {"t.py::a": "reads internals", "t.py::b": "attaches a connector"}
    assert compare(off, all_, listed, complete=True).ok
    reasonless = compare(off, all_, {**listed, "t.py::b": ""}, complete=True)
    assert reasonless.reasonless == ["t.py::b"]
    assert not reasonless.ok


def test_passing_only_with_kvblocks_is_a_difference_too() -> None:
    off, all_ = runs(a=("failed", "passed"))
    assert compare(off, all_, {}, complete=True).unlisted == ["t.py::a"]


def test_a_listed_test_that_behaves_as_stock_is_stale() -> None:
    off, all_ = runs(a=("passed", "passed"))
    result = compare(off, all_, {"t.py::a": "was fixed"}, complete=True)
    assert result.stale == ["t.py::a"]
    assert not result.ok


def test_a_listed_test_that_did_not_run_is_stale_only_in_a_complete_run() -> None:
    off, all_ = runs(a=("passed", "passed"))
    expected = {"t.py::gone": "renamed upstream"}
    assert compare(off, all_, expected, complete=True).stale == ["t.py::gone"]
    assert compare(off, all_, expected, complete=False).ok


def test_different_errors_in_both_runs_are_reported_not_failed() -> None:
    off, all_ = runs(a=("failed", "failed"))
    all_["t.py::a"]["message"] = "other"
    result = compare(off, all_, {}, complete=True)
    assert result.ok
    assert result.changed_message == ["t.py::a"]


def test_the_list_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "expected.txt"
    path.write_text(
        "# header\n\n"
        + entry_line("t.py::a[x-1]", "reads `block_pool`")
        + "\n"
        + entry_line("t.py::b", "")
        + "\n"
    )
    assert read_expected(path) == {"t.py::a[x-1]": "reads `block_pool`", "t.py::b": ""}


@pytest.mark.parametrize("line", ["not-a-node-id  # why", "t.py::a  # x\nt.py::a  # y"])
def test_a_malformed_list_is_refused(tmp_path: Path, line: str) -> None:
    path = tmp_path / "expected.txt"
    path.write_text(line + "\n")
    with pytest.raises(ValueError):
        read_expected(path)


def test_regeneration_keeps_reasons_and_entries_that_did_not_run() -> None:
    off, all_ = runs(a=("passed", "failed"), b=("passed", "failed"), c=("passed", "passed"))
    expected = {"t.py::a": "reason a", "t.py::c": "stale", "t.py::other": "not run"}
    result = compare(off, all_, expected, complete=False)
    assert regenerated(expected, result, ran=off.keys()) == [
        entry_line("t.py::a", "reason a"),
        entry_line("t.py::b", ""),
        entry_line("t.py::other", "not run"),
    ]
