"""``kvblocks.vllm.status()`` before and after vLLM loads the plugin; needs no vLLM (each case
runs in a fresh process, where nothing has loaded the plugin yet)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.fresh_process import run_python


def fresh_process(code: str, kvblocks_vllm: str | None) -> list[str]:
    env = {} if kvblocks_vllm is None else {"KVBLOCKS_VLLM": kvblocks_vllm}
    out = run_python("import kvblocks.vllm as v\n" + code, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def installed_vllm() -> str:
    """How status() names the installed vLLM."""
    try:
        return f"vllm {version('vllm')}"
    except PackageNotFoundError:
        return "vLLM not installed"


@pytest.mark.parametrize(("env", "mode"), [(None, "all"), ("hasher", "hasher"), (" OFF ", "off")])
def test_a_fresh_process_says_vllm_has_not_loaded_it_yet(env: str | None, mode: str) -> None:
    lines = fresh_process("print(v.status())\nprint(v.status().mode)", env)
    assert lines == [
        "kvblocks.vllm: not loaded yet: vLLM loads kvblocks when an engine starts; "
        f"KVBLOCKS_VLLM={mode}, {installed_vllm()}",
        "off",  # the mode installed: none yet
    ]


def test_once_loaded_off_or_uninstalled_it_says_mode_off() -> None:
    # register() is what vLLM's plugin loader calls; with "off" it installs nothing.
    lines = fresh_process("v.register()\nprint(v.status())\nprint(v.status().pending_mode)", "off")
    assert lines == [f"kvblocks.vllm: mode=off, {installed_vllm()}: nothing active", "None"]
    lines = fresh_process("v.uninstall()\nprint(v.status())", None)
    assert lines == [f"kvblocks.vllm: mode=off, {installed_vllm()}: nothing active"]
