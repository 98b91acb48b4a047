"""vLLM's own tests, from its source distribution on PyPI, unpacked once into the cache.

The wheel does not ship ``tests/``; the sdist does. Only ``tests/`` and ``pyproject.toml``
(pytest's configuration: vLLM's markers) are unpacked: the sdist's ``vllm/`` source must not
sit next to the tests, or subprocesses started from that directory (vLLM inspects model
classes in a child ``python -m vllm...``) would import it instead of the installed wheel.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
FILENAME = f"vllm-{VERSION}.tar.gz"
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691
WANTED = ("tests/", "pyproject.toml")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sdist_url() -> str:
    """The sdist's download URL, from PyPI's simple JSON index (no vLLM metadata build)."""
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    for file in index["files"]:
        if file["filename"] == FILENAME:
            listed = file.get("hashes", {}).get("sha256")
            if listed != SHA256:
                raise RuntimeError(f"PyPI lists sha256 {listed} for {FILENAME}, pinned {SHA256}")
            return str(file["url"])
    raise RuntimeError(f"{FILENAME} is not on {SIMPLE_INDEX}")


def download(target: Path) -> None:
    url = sdist_url()
    print(f"vllm_suite: downloading {url}", flush=True)
    partial = target.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as file:
        shutil.copyfileobj(response, file, 1 << 20)
    partial.replace(target)


def verified_archive(cache: Path, given: Path | None) -> Path:
    """The sdist (``given``, the cached copy, or a fresh download) after its sha256 check."""
    archive = given if given is not None else cache / FILENAME
    if given is None and not archive.exists():
        download(archive)
    actual = sha256_of(archive)
    if actual != SHA256:
        if given is None:
            archive.unlink()  # a corrupt cached download is fetched again next time
        raise RuntimeError(f"{archive}: sha256 {actual}, expected {SHA256}")
    return archive


def ensure_tests(cache: Path, given: Path | None = None) -> Path:
    """The directory holding vLLM's ``tests`` package and ``pyproject.toml``; unpacked from
    the verified sdist unless a complete copy is already in the cache."""
    root = cache / f"vllm-{VERSION}"
    stamp = root / ".unpacked-from"
    if stamp.exists() and stamp.read_text().strip() == SHA256:
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = verified_archive(cache, given)
    prefix = f"vllm-{VERSION}/"
    staging = Path(tempfile.mkdtemp(prefix="unpack-", dir=cache))
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(WANTED)
        ]
        tar.extractall(staging, members=members, filter="data")
    (staging / prefix / ".unpacked-from").write_text(SHA256 + "\n")
    if root.exists():
        shutil.rmtree(root)
    (staging / prefix).replace(root)
    shutil.rmtree(staging)
    return root
