"""Comparing the ``KVBLOCKS_VLLM=off`` and ``=all`` runs against the expected-failures list.

A test is *as stock* when its outcome is the same in both runs. Every test that is not (it
fails with kvblocks and passes without, or the other way round) must be listed in the
release's expected-failures list (``expected_failures.txt`` for vLLM 0.33.0,
``expected_failures-<version>.txt`` for later ones; releases.py) with a reason; a listed test
that is now as stock, or no longer exists, is a stale entry. Either makes the tier fail, so
the list stays exactly true.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEPARATOR = "  # "
OK = ("passed", "xfailed")  # xfailed: the test's own expectation held


def read_expected(path: Path) -> dict[str, str]:
    """``node id -> reason``; a line is ``<node id>  # <reason>`` (the reason may be empty,
    which the comparison reports as a failure until someone writes one)."""
    entries: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        nodeid, _, reason = line.partition(SEPARATOR.strip())
        nodeid = nodeid.strip()
        if "::" not in nodeid:
            raise ValueError(f"{path}:{number}: not a pytest node id: {nodeid!r}")
        if nodeid in entries:
            raise ValueError(f"{path}:{number}: {nodeid} is listed twice")
        entries[nodeid] = reason.strip()
    return entries


def entry_line(nodeid: str, reason: str = "") -> str:
    return f"{nodeid}{SEPARATOR}{reason}".rstrip()


@dataclass
class Comparison:
    #: node id -> (outcome off, outcome all) for every test whose outcome differs
    differing: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: differing tests not listed (they fail the tier)
    unlisted: list[str] = field(default_factory=list)
    #: listed tests that now behave as stock, or were not collected (they fail the tier)
    stale: list[str] = field(default_factory=list)
    #: listed and differing, but the entry gives no reason (they fail the tier)
    reasonless: list[str] = field(default_factory=list)
    #: not ok in both runs, with a different first line of the error (printed, not failing)
    changed_message: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unlisted or self.stale or self.reasonless)


def compare(
    off: Mapping[str, Mapping[str, Any]],
    all_: Mapping[str, Mapping[str, Any]],
    expected: dict[str, str],
    *,
    complete: bool,
) -> Comparison:
    """``off`` / ``all_``: the plugin's per-test records. ``complete``: the whole selection
    ran (no ``-k``), so a listed test that was not collected is stale."""
    result = Comparison()
    for nodeid in sorted(off.keys() | all_.keys()):
        before = str(off.get(nodeid, {}).get("outcome", "missing"))
        after = str(all_.get(nodeid, {}).get("outcome", "missing"))
        if before == after or (before in OK and after in OK):
            if nodeid in expected:
                result.stale.append(nodeid)
            if before not in OK and off[nodeid].get("message") != all_[nodeid].get("message"):
                result.changed_message.append(nodeid)
            continue
        result.differing[nodeid] = (before, after)
        if nodeid not in expected:
            result.unlisted.append(nodeid)
        elif not expected[nodeid]:
            result.reasonless.append(nodeid)
    if complete:
        ran = off.keys() | all_.keys()
        result.stale.extend(sorted(n for n in expected if n not in ran))
    return result


def regenerated(
    expected: dict[str, str], comparison: Comparison, *, ran: Iterable[str]
) -> list[str]:
    """The list's new entries: every differing test, keeping the reasons already written,
    and the entries of tests that did not run (a run of some files or ``-k``)."""
    kept = set(expected) - set(ran)
    return [entry_line(n, expected.get(n, "")) for n in sorted(kept | comparison.differing.keys())]
