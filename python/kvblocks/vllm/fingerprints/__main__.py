"""``python -m kvblocks.vllm.fingerprints [--diff | --write [--parts P,Q]]``: compares the
installed vllm's sources (or ``--vllm-root``'s) with kvblocks' stored fingerprints and prints
what differs, by part, each object changed, new or removed (``--diff``, the default);
``--write`` (when a new vLLM release has been ported and tested) stores the installed vllm's
fingerprints as ``vllm-<version>.json``, of the parts ported to it (``--parts``; default
all). Compared with that release's file, or else the newest stored one. Exit status: 0 when
nothing differs (or after writing), 1 when something does."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kvblocks.vllm.fingerprints as fp
from kvblocks.vllm.fingerprints.ported import PORTED


def _installed_version() -> str:
    from importlib.metadata import version

    return version("vllm")


def _baseline(version: str, directory: Path) -> Path | None:
    path = fp.stored_path(version, directory)
    if path.exists():
        return path
    older = fp.stored_versions(directory)
    return fp.stored_path(older[-1], directory) if older else None


def _print_changes(document: fp.Document, root: Path) -> bool:
    """Prints each part's differences from ``document`` (a part it does not hold: not ported
    to that release); True when there are any."""
    found = fp.changes(document, root)
    missing = fp.not_ported(document)
    for part in PORTED:
        if part in missing:
            print(f"{part}: not ported to vllm {document.get('vllm')}")
            continue
        diffs = found.get(part, [])
        print(f"{part}: {'unchanged' if not diffs else f'{len(diffs)} differ'}")
        for change in diffs:
            print(f"  {change.kind:8} {change.name}")
    return bool(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvblocks.vllm.fingerprints")
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--diff",
        action="store_true",
        help="list what differs from the stored fingerprints, by part (the default)",
    )
    action.add_argument("--write", action="store_true", help="store the installed vllm's")
    parser.add_argument("--vllm-root", type=Path, help="the directory holding vllm/")
    parser.add_argument("--version", help="the vllm version (default: the installed one)")
    parser.add_argument("--dir", type=Path, default=fp.DIRECTORY, help="the fingerprint files")
    parser.add_argument(
        "--parts",
        help=f"with --write: the parts ported to this release, comma-separated (default: all of "
        f"{', '.join(PORTED)})",
    )
    args = parser.parse_args(argv)
    root = args.vllm_root or fp.vllm_root()
    version = args.version or _installed_version()
    print(f"vllm {version} at {root / 'vllm'}")
    baseline = _baseline(version, args.dir)
    differs = True
    if baseline is None:
        print("no stored fingerprints to compare with")
    else:
        print(f"compared with {baseline}")
        differs = _print_changes(fp.load(baseline), root)
    if not args.write:
        return 1 if differs or baseline != fp.stored_path(version, args.dir) else 0
    parts = args.parts.split(",") if args.parts else None
    try:
        document = fp.compute(root, version, parts)
    except LookupError as error:
        parser.error(str(error))
    path = fp.stored_path(version, args.dir)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
