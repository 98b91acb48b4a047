"""PORTING AID, TEST ONLY (docs/porting.md): with ``KVBLOCKS_PORTING_OPEN=1``, every kvblocks
part runs on the installed vLLM, whose sources are fingerprinted afresh into a temporary
directory, so that the differential tier shows what a release kvblocks is not ported to yet
does differently. The tier's conftest calls :func:`open_guard_if_asked` in the test process,
and the tier's child processes (``test_engine_core.py``) call it in theirs."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ENV_VAR = "KVBLOCKS_PORTING_OPEN"


def open_guard_if_asked() -> None:
    if os.environ.get(ENV_VAR) != "1":
        return
    from kvblocks.vllm import fingerprints
    from kvblocks.vllm.versions import installed_vllm_version

    directory = Path(tempfile.mkdtemp(prefix="kvblocks-porting-"))
    version = installed_vllm_version() or "unknown"
    document = fingerprints.compute(fingerprints.vllm_root(), version)
    fingerprints.stored_path(version, directory).write_text(json.dumps(document))
    fingerprints.DIRECTORY = directory
    fingerprints.forget()
