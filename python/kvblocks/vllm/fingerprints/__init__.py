"""Which vLLM exactly: fingerprints of the vLLM sources each kvblocks part reproduces.

For every vLLM release kvblocks reproduces, ``vllm-<version>.json`` beside this file holds
the sha256 of each source :mod:`.ported` lists for that release, by part: the parts kvblocks
is ported to there (a release may hold fewer parts than another while a port is under way).
:func:`check` compares them with the installed vllm's files (found from the package's
location, read, never imported): a part whose sources differ, a part the file does not hold,
or any part of a vLLM release without a fingerprint file, falls back to vLLM's own code. A
patch release can change an allocation rule without changing a signature; this is what
notices.

The check reads a handful of files once per process (about a millisecond: each file's own
hash is compared first, and only a file that differs is parsed to see which objects changed)
and never raises. ``python -m kvblocks.vllm.fingerprints --write`` records a new release.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvblocks.vllm._state import Reason
from kvblocks.vllm.fingerprints.extract import Module, sha256
from kvblocks.vllm.fingerprints.ported import PORTED, Source, release, sources

__all__ = [
    "FORMAT",
    "Change",
    "changes",
    "check",
    "compute",
    "forget",
    "load",
    "not_ported",
    "stored_path",
]

#: The version of the file layout below.
FORMAT = 1
#: Where the fingerprint files live.
DIRECTORY = Path(__file__).parent

Document = dict[str, Any]


@dataclass(frozen=True, order=True)
class Change:
    """One difference from the stored fingerprints, e.g. ``("changed",
    "vllm/v1/core/block_pool.py")`` or ``("removed", "vllm/v1/request.py::Request.num_tokens")``."""

    kind: str  # "changed", "new" (not in the stored file) or "removed" (not in vllm any more)
    name: str

    def __str__(self) -> str:
        return self.name if self.kind == "changed" else f"{self.name} ({self.kind})"


def public_version(version: str) -> str:
    """``0.33.0+cu129`` -> ``0.33.0``: builds of one release share their Python sources, and
    the fingerprints decide whether they really do."""
    return version.split("+", 1)[0]


def stored_path(version: str, directory: Path | None = None) -> Path:
    return (directory or DIRECTORY) / f"vllm-{public_version(version)}.json"


def stored_versions(directory: Path | None = None) -> list[str]:
    """The releases with a fingerprint file, oldest first."""

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", version))

    names = (p.name for p in (directory or DIRECTORY).glob("vllm-*.json"))
    return sorted((n[len("vllm-") : -len(".json")] for n in names), key=key)


def vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _entry(source: Source, data: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {"sha256": sha256(data)}
    if source.mentions:
        entry["mentions"] = list(source.mentions)
        entry["objects"] = Module(data).mentions(source.mentions)
    elif source.objects:
        objects = Module(data).objects(source.objects)
        missing = sorted(set(source.objects) - set(objects))
        if missing:
            raise LookupError(f"{source.path}: no {', '.join(missing)}")
        entry["objects"] = objects
    return entry


def compute(root: Path, version: str, parts: list[str] | None = None) -> Document:
    """The fingerprints of the vllm sources under ``root`` (vLLM ``version``) of ``parts``
    (default: every part): what ``--write`` stores. Raises ``LookupError`` when a ported
    object is missing or a part unknown, ``OSError`` when a file is missing."""
    unknown = sorted(set(parts or ()) - set(PORTED))
    if unknown:
        raise LookupError(f"no part {', '.join(unknown)}; the parts: {', '.join(PORTED)}")
    stored = {
        part: {s.path: _entry(s, (root / s.path).read_bytes()) for s in sources(part, version)}
        for part in PORTED
        if parts is None or part in parts
    }
    return {"format": FORMAT, "vllm": public_version(version), "parts": stored}


def load(path: Path) -> Document:
    """A stored fingerprint file; ``ValueError`` when it is not one."""
    document = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{path.name}: not a kvblocks fingerprint file of format {FORMAT}")
    parts = document.get("parts")
    if not isinstance(parts, dict) or not all(isinstance(p, dict) for p in parts.values()):
        raise ValueError(f"{path.name}: no parts")
    return document


def _same_selection(source: Source, entry: dict[str, Any]) -> bool:
    if source.mentions:
        return entry.get("mentions") == list(source.mentions)
    if source.objects:
        objects = entry.get("objects")
        return isinstance(objects, dict) and set(objects) == set(source.objects)
    return "objects" not in entry


def _diff(path: str, stored: dict[str, str], current: dict[str, str]) -> list[Change]:
    out = []
    for name in sorted(set(stored) | set(current)):
        full = f"{path}::{name}"
        if name not in current:
            out.append(Change("removed", full))
        elif name not in stored:
            out.append(Change("new", full))
        elif stored[name] != current[name]:
            out.append(Change("changed", full))
    return out


def source_changes(source: Source, entry: dict[str, Any] | None, root: Path) -> list[Change]:
    """How ``source`` under ``root`` differs from its stored ``entry``."""
    try:
        data = (root / source.path).read_bytes()
    except OSError:
        return [Change("removed", source.path)]
    if entry is None:
        return [Change("new", source.path)]
    if entry.get("sha256") == sha256(data) and _same_selection(source, entry):
        return []  # the common case: the file is byte for byte the one fingerprinted
    if source.whole_file:
        return [Change("changed", source.path)]
    try:
        module = Module(data)
    except (SyntaxError, ValueError):
        return [Change("changed", source.path)]
    current = (
        module.mentions(source.mentions) if source.mentions else module.objects(source.objects)
    )
    stored = entry.get("objects")
    if not isinstance(stored, dict):
        stored = {}
    return _diff(source.path, stored, current)


def changes(document: Document, root: Path) -> dict[str, list[Change]]:
    """Part -> how the sources it reproduces under ``root`` differ from ``document`` (the
    sources of the document's release; only the parts the document holds)."""
    out: dict[str, list[Change]] = {}
    version = str(document.get("vllm", ""))
    for part in PORTED:
        stored = document["parts"].get(part)
        if stored is None:
            continue
        found = [
            c for s in sources(part, version) for c in source_changes(s, stored.get(s.path), root)
        ]
        if found:
            out[part] = found
    return out


def not_ported(document: Document) -> list[str]:
    """The parts a fingerprint file does not hold: kvblocks is not ported to that release for
    them (yet)."""
    return [part for part in PORTED if part not in document["parts"]]


_lock = threading.Lock()
_cache: dict[tuple[str, str, str], dict[str, tuple[str, str]]] = {}


def forget() -> None:
    """Drops the cached result of :func:`check` (tests; a vllm replaced in place)."""
    with _lock:
        _cache.clear()


def check(version: str | None = None) -> dict[str, tuple[str, str]]:
    """Part -> ``(reason, detail)`` for each part that must fall back because the installed
    vllm is not one whose sources kvblocks reproduces; ``{}`` when all are. Cached per
    process; never raises (anything unexpected makes every part fall back, saying why)."""
    try:
        if version is None:
            from kvblocks.vllm.versions import installed_vllm_version

            version = installed_vllm_version() or "unknown"
        root = vllm_root()
        key = (str(root), version, str(DIRECTORY))
    except Exception as error:
        return _all(Reason.VLLM_UNKNOWN, f"cannot locate vllm: {error}")
    with _lock:
        result = _cache.get(key)
        if result is None:
            result = _cache[key] = _check(root, version)
        return dict(result)


def _all(reason: Reason, detail: str) -> dict[str, tuple[str, str]]:
    return {part: (reason, detail) for part in PORTED}


def _check(root: Path, version: str) -> dict[str, tuple[str, str]]:
    path = stored_path(version)
    if not path.exists():
        # A patch release runs where its sources are those of a fingerprinted release of the
        # same major.minor (the newest): the comparison decides, as for any release.
        same_release = [v for v in stored_versions() if release(v) == release(version)]
        if not same_release:
            known = ", ".join(stored_versions()) or "none"
            return _all(
                Reason.VLLM_UNKNOWN, f"no fingerprints of vllm {version} (kvblocks has: {known})"
            )
        path = stored_path(same_release[-1])
    try:
        document = load(path)
        found = changes(document, root)
    except Exception as error:
        return _all(Reason.VLLM_UNKNOWN, f"{path.name} unusable: {error}")
    compared = public_version(str(document.get("vllm", "")))
    against = "" if compared == public_version(version) else f" (against {compared}'s sources)"
    result: dict[str, tuple[str, str]] = {
        part: (Reason.VLLM_SOURCES, f"vllm {version}{against}: {', '.join(map(str, diffs))}")
        for part, diffs in found.items()
    }
    ported = ", ".join(document["parts"]) or "none"
    for part in not_ported(document):
        result[part] = (
            Reason.NOT_PORTED,
            f"vllm {public_version(version)}; ported there: {ported}; see docs/porting.md",
        )
    return result
