"""Python code run in a fresh child process that imports the same kvblocks as the tests (a
reader running one snippet; a process where vLLM has not loaded the plugin yet)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import kvblocks

#: The repository checkout (``tests.vllm_driver`` imports from it; last on a child's path).
CHECKOUT = str(Path(__file__).resolve().parents[1])
#: A new user's environment has none of these; a child gets them only when asked.
PLUGIN_SETTINGS = ("KVBLOCKS_VLLM", "VLLM_PLUGINS")


def run_python(
    code: str, *, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with this environment less :data:`PLUGIN_SETTINGS`, plus ``env``."""
    return _run(["-c", code], env, cwd)


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kvblocks ARGS`` (the ``kvblocks`` command) as :func:`run_python` runs code."""
    return _run(["-m", "kvblocks", *args], env, None)


def _run(
    argv: list[str], env: Mapping[str, str] | None, cwd: Path | None
) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if k not in PLUGIN_SETTINGS}
    child.update(env or {})
    source = str(Path(kvblocks.__file__).resolve().parents[1])
    paths = (source, child.get("PYTHONPATH"), CHECKOUT)  # the checkout: the test driver
    child["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=child,
        cwd=cwd,
        timeout=600,
    )
