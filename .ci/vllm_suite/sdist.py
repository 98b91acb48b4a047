"""vLLM's own tests, from a release's source distribution on PyPI, unpacked once into the
cache (``<cache>/vllm-<version>-sdist``, apart from any ``<cache>/vllm-<version>`` tree that
holds an installed wheel).

The wheel does not ship ``tests/``; the sdist does. Only ``tests/``, ``pyproject.toml``
(pytest's configuration: vLLM's markers) and the data files a release's tests read
(``Release.unpack``) are unpacked: the sdist's ``vllm/`` source must not sit next to the
tests, or subprocesses started from that directory (vLLM inspects model classes in a child
``python -m vllm...``) would import it instead of the wheel under test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from releases import Release

SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sdist_url(filename: str, sha256: str) -> str:
    """The sdist's download URL, from PyPI's simple JSON index (no vLLM metadata build)."""
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    for file in index["files"]:
        if file["filename"] == filename:
            listed = file.get("hashes", {}).get("sha256")
            if listed != sha256:
                raise RuntimeError(f"PyPI lists sha256 {listed} for {filename}, pinned {sha256}")
            return str(file["url"])
    raise RuntimeError(f"{filename} is not on {SIMPLE_INDEX}")


def download(target: Path, sha256: str) -> None:
    url = sdist_url(target.name, sha256)
    print(f"vllm_suite: downloading {url}", flush=True)
    partial = target.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as file:
        shutil.copyfileobj(response, file, 1 << 20)
    partial.replace(target)


def verified_archive(cache: Path, given: Path | None, release: Release) -> Path:
    """The sdist (``given``, the cached copy, or a fresh download) after its sha256 check."""
    archive = given if given is not None else cache / f"vllm-{release.version}.tar.gz"
    if given is None and not archive.exists():
        download(archive, release.sdist_sha256)
    actual = sha256_of(archive)
    if actual != release.sdist_sha256:
        if given is None:
            archive.unlink()  # a corrupt cached download is fetched again next time
        raise RuntimeError(f"{archive}: sha256 {actual}, expected {release.sdist_sha256}")
    return archive


def ensure_tests(cache: Path, release: Release, given: Path | None = None) -> Path:
    """The directory holding the release's ``tests`` package and ``pyproject.toml``;
    unpacked from the verified sdist unless a complete copy is already in the cache."""
    root = cache / f"vllm-{release.version}-sdist"
    stamp = root / ".unpacked-from"
    # what was unpacked from which archive: a changed selection unpacks again
    unpacked = " ".join((release.sdist_sha256, *release.unpack))
    if stamp.exists() and stamp.read_text().strip() == unpacked:
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = verified_archive(cache, given, release)
    prefix = f"vllm-{release.version}/"
    staging = Path(tempfile.mkdtemp(prefix="unpack-", dir=cache))
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(release.unpack)
        ]
        tar.extractall(staging, members=members, filter="data")
    (staging / prefix / ".unpacked-from").write_text(unpacked + "\n")
    if root.exists():
        shutil.rmtree(root)
    (staging / prefix).replace(root)
    shutil.rmtree(staging)
    return root
