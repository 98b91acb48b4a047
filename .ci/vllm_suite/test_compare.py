"""The tier's comparison rules and per-release choices
(``python -m pytest .ci/vllm_suite/test_compare.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import releases
from compare import compare, entry_line, read_expected, regenerated
from kvblocks_suite_plugin import tell_cpu_platform_triton_is_there

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


def test_each_release_has_its_own_expected_list_and_it_parses() -> None:
    assert releases.release("0.33.0").expected.name == "expected_failures.txt"
    assert releases.release("0.34.0").expected.name == "expected_failures-0.34.0.txt"
    for release in releases.RELEASES.values():
        read_expected(release.expected)  # exists and is well formed


def test_a_release_without_a_selection_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"0\.35\.0"):
        releases.release("0.35.0")


def test_the_selections_follow_each_release_s_tree() -> None:
    old, new = releases.release("0.33.0").test_files, releases.release("0.34.0").test_files
    lifecycle = "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py"  # gone in 0.34
    vectors = "tests/v1/core/test_prompt_block_hash_vectors.py"  # new in 0.34
    assert lifecycle in old
    assert lifecycle not in new
    assert vectors in new
    assert vectors not in old
    for files in (old, new):
        assert len(set(files)) == len(files)


def test_the_version_comes_from_the_tree_under_test(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        releases.vllm_version(tmp_path)  # no vLLM there
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    info = tmp_path / "vllm-0.34.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    assert releases.vllm_version(tmp_path) == "0.34.0"


def records(*, schedulers: int = 0, hashed: int = 0) -> list[dict[str, int]]:
    return [{"kvblocks": 0, "hashed": 0}, {"kvblocks": schedulers, "hashed": hashed}]


@pytest.mark.parametrize(
    ("version", "schedulers", "hashed", "ok"),
    [
        ("0.33.0", 3, 5, True),
        ("0.33.0", 0, 5, False),  # kvblocks' manager fell back everywhere
        ("0.33.0", 3, 0, False),  # kvblocks' hasher fell back everywhere
        ("0.34.0", 3, 5, True),  # both parts are ported to 0.34
        ("0.34.0", 0, 5, False),  # kvblocks' manager fell back everywhere
        ("0.34.0", 0, 0, False),
    ],
)
def test_each_ported_part_must_do_work_in_the_all_run(
    version: str, schedulers: int, hashed: int, ok: bool
) -> None:
    ported = releases.release(version).ported
    all_ = records(schedulers=schedulers, hashed=hashed)
    assert (releases.activity_failures(ported, records(), all_) == []) is ok


@pytest.mark.parametrize("work", [{"schedulers": 1}, {"hashed": 1}])
def test_no_part_may_work_in_the_off_run(work: dict[str, int]) -> None:
    all_ = records(schedulers=3, hashed=5)
    failures = releases.activity_failures(("hasher",), records(**work), all_)
    assert len(failures) == 1
    assert "off run" in failures[0]


def test_the_cpu_platform_is_told_triton_is_there_only_during_its_check() -> None:
    class TritonUtils:
        HAS_TRITON = False

    seen: list[bool] = []

    class Platform:
        @classmethod
        def check_and_update_config(cls, vllm_config: object) -> None:
            seen.append(TritonUtils.HAS_TRITON)
            if not TritonUtils.HAS_TRITON:
                raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")

    with pytest.raises(RuntimeError):
        Platform.check_and_update_config(None)
    assert tell_cpu_platform_triton_is_there(Platform, TritonUtils)
    Platform.check_and_update_config(None)
    assert seen == [False, True]
    assert TritonUtils.HAS_TRITON is False

    class WithoutCheck:
        pass

    assert not tell_cpu_platform_triton_is_there(WithoutCheck, TritonUtils)
    assert not hasattr(WithoutCheck, "check_and_update_config")


def test_only_blocks_kvblocks_hashed_itself_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import Counter

    import kvblocks_suite_plugin as plugin

    from kvblocks.vllm import _state, block_hasher

    monkeypatch.setattr(_state, "fallbacks", Counter())
    monkeypatch.setattr(plugin, "_tests", {})

    def make(answer: str) -> object:
        def request_block_hasher(request: object) -> list[bytes]:
            if answer == "kvblocks":
                return [b"a", b"b"]
            if answer == "vllm":  # kvblocks handed the request to vLLM's hasher
                _state.fall_back("hasher", "bad_field", quiet=True)
                return [b"c"]
            return []

        return request_block_hasher

    monkeypatch.setattr(block_hasher, "_make_hasher", make)
    plugin._watch_hasher()
    for answer in ("kvblocks", "vllm", "none", "kvblocks"):
        block_hasher._make_hasher(answer)(object())
    assert plugin._tests[""]["hashed"] == 4
