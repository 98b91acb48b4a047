"""Importing kvblocks changes no environment variable: every module of the package, imported
in a fresh interpreter with ``os.environ`` watched, writes nothing there itself (what its
imports of other packages write, e.g. vLLM's own settings, is theirs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvblocks

# Run in a child: imports every module of the package (but ``__main__``, which runs the CLI),
# and records each write to ``os.environ`` with the module whose code made it.
CHILD = r"""
import importlib, importlib.util, json, os, pkgutil, sys

WRAPPERS = {"os", "_collections_abc", "collections.abc"}
writes = []

class Watched(type(os.environ)):
    def _writer(self):
        frame = sys._getframe(2)
        while frame.f_globals.get("__name__") in WRAPPERS:
            frame = frame.f_back
        return frame.f_globals.get("__name__")

    def __setitem__(self, key, value):
        writes.append([self._writer(), key])
        super().__setitem__(key, value)

    def __delitem__(self, key):
        writes.append([self._writer(), key])
        super().__delitem__(key)

os.environ.__class__ = Watched
import kvblocks

imported, missing = [], {}
for info in pkgutil.walk_packages(kvblocks.__path__, "kvblocks."):
    if info.name.endswith(".__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as error:  # an optional dependency (vllm, torch, triton)
        if (error.name or "").startswith("kvblocks"):
            raise
        missing[info.name] = error.name
        continue
    imported.append(info.name)
has_vllm = importlib.util.find_spec("vllm") is not None
print(json.dumps(
    {"imported": imported, "missing": missing, "writes": writes, "has_vllm": has_vllm}
))
"""


def _import_everything(env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_no_module_of_the_package_sets_environment_variables_at_import() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "KVBLOCKS_VLLM")}
    package_root = str(Path(kvblocks.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    result = _import_everything(env)
    assert [w for w in result["writes"] if str(w[0]).startswith("kvblocks")] == []
    # Not vacuous: the package's modules were imported, and where vLLM is installed, the
    # watch saw vLLM set its own variables as it was imported.
    imported = set(result["imported"])
    assert {"kvblocks.cli", "kvblocks.vllm.block_hasher"} <= imported
    if "torch" not in result["missing"].values():  # the engine is the [torch] extra's
        assert "kvblocks.engine" in imported
    # Every module of kvblocks' vLLM integration imports with or without vLLM.
    assert {"kvblocks.vllm.bench", "kvblocks.vllm.bench.config"} <= imported
    if result["has_vllm"]:
        assert {w[0].split(".")[0] for w in result["writes"]} >= {"vllm"}


def test_the_engine_without_torch_says_how_to_install_it() -> None:
    """``from kvblocks import LLM`` where torch is missing: the install hint, not torch's
    bare ModuleNotFoundError (torch is hidden from a fresh interpreter)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n"
        "    from kvblocks import LLM\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    package_root = str(Path(kvblocks.__file__).parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == (
        "torch | kvblocks.LLM (the embedded engine) needs torch: "
        'pip install ".[torch]" in a kvblocks checkout\n'
    )
