"""The plugin as vLLM loads it, its controls, and whole scheduler runs with it on and off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import vllm.plugins
from vllm.config import CacheConfig
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched import scheduler as scheduler_module

import kvblocks.vllm
from kvblocks.vllm import _state
from tests.vllm_driver import LAYOUTS, VOCAB_SIZE, SchedulerSpec, block_hasher
from tests.vllm_driver.config import scheduler_only_cpu_platform
from tests.vllm_tier.harness import (
    HASHER_MODULES,
    assert_same,
    both,
    shared_prefix_script,
)

OURS = HASHER_MODULES["kvblocks"]
STOCK = HASHER_MODULES["vllm"]


def load_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own plugin loading, as EngineCore runs it (once per process: reset the flag)."""
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()


@pytest.mark.parametrize(
    ("env", "expected"), [(None, OURS), ("all", OURS), ("hasher", OURS), ("off", STOCK)]
)
def test_loaded_through_vllm_entry_point(
    env: str | None, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    if env is None:
        monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    else:
        monkeypatch.setenv("KVBLOCKS_VLLM", env)
    load_plugins(monkeypatch)
    assert kv_cache_utils.get_request_block_hasher.__module__ == expected
    assert kvblocks.vllm.status().mode == (env or "all")


def test_vllm_plugins_can_exclude_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    load_plugins(monkeypatch)
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin,kvblocks")
    load_plugins(monkeypatch)
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS


def test_register_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    kvblocks.vllm.register()
    first = kv_cache_utils.get_request_block_hasher
    kvblocks.vllm.register()
    assert kv_cache_utils.get_request_block_hasher is first
    kvblocks.vllm.uninstall()
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK


def test_unsupported_vllm_version_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kvblocks.vllm.versions, "installed_vllm_version", lambda: "0.35.0")
    monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.kvblocks"):
        kvblocks.vllm.register()
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    status = kvblocks.vllm.status()
    assert status.mode == "off"
    assert status.active == {}
    # The refusal is a fallback of each part, with what to do.
    assert sorted(status.fallbacks) == [
        f"{part}: a vLLM release this version of kvblocks does not support (vllm 0.35.0; to "
        "use kvblocks, install a kvblocks release that supports vllm 0.35.0, or pip install "
        '"vllm>=0.33,<0.35")'
        for part in ("hasher", "kv_cache_manager")
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not vllm 0.35.0" in warnings[0].getMessage()
    assert 'pip install "vllm>=0.33,<0.35"' in warnings[0].getMessage()
    kvblocks.vllm.register()  # vLLM loads plugins in each process it starts: still one line
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    with pytest.raises(ImportError, match=r"not vllm 0\.35\.0"):
        kvblocks.vllm.install()


def test_scheduler_cls_on_an_unsupported_vllm_builds_vllms_manager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, model_dir: Path
) -> None:
    """``--scheduler-cls kvblocks.vllm.Scheduler`` with the plugin off, on a vLLM release
    kvblocks does not support: vLLM's manager, the refusal recorded, one warning."""
    from tests.vllm_driver import make_scheduler

    kvblocks.vllm.uninstall()
    monkeypatch.setattr(kvblocks.vllm.versions, "installed_vllm_version", lambda: "0.35.0")
    spec = SchedulerSpec(block_size=16, num_blocks=64)
    with caplog.at_level(logging.WARNING, logger="vllm.kvblocks"):
        for cls in (kvblocks.vllm.Scheduler, kvblocks.vllm.AsyncScheduler):
            scheduler = make_scheduler(model_dir, spec, scheduler_cls=cls)
            assert type(scheduler.kv_cache_manager) is VllmKVCacheManager
    status = kvblocks.vllm.status()
    assert status.active == {}
    ((reason, count),) = status.fallbacks.items()
    assert reason.startswith("kv_cache_manager: a vLLM release this version of kvblocks does")
    assert count == 2
    (warning,) = [r for r in caplog.records if r.name == "vllm.kvblocks"]
    assert warning.levelno == logging.WARNING
    assert "not vllm 0.35.0" in warning.getMessage()


def test_bad_mode(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        kvblocks.vllm.install("fast")
    monkeypatch.setenv("KVBLOCKS_VLLM", "fast")
    with caplog.at_level(logging.WARNING, logger="vllm.kvblocks"):
        kvblocks.vllm.register()  # never raises inside vLLM's start-up
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    assert any("unknown mode" in r.getMessage() for r in caplog.records)


def test_off_is_silent(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVBLOCKS_VLLM", "off")
    with caplog.at_level(logging.DEBUG, logger="vllm.kvblocks"):
        kvblocks.vllm.register()
    assert caplog.records == []
    assert kvblocks.vllm.status().active == {}


def test_one_info_line_says_what_is_active(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        kvblocks.vllm.install()
        block_hasher("sha256_cbor", 16)
        block_hasher("sha256_cbor", 16)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("hasher runs on kvblocks (sha256_cbor)" in line for line in lines) == 1, lines


def test_status_str_names_parts_and_fallbacks() -> None:
    kvblocks.vllm.install()
    _state.fallbacks.clear()
    block_hasher("sha256", 16)

    def custom_hash(obj: object) -> bytes:
        return b"\0" * 32

    kv_cache_utils.get_request_block_hasher(16, custom_hash)  # a function kvblocks lacks
    kv_cache_utils.get_request_block_hasher(16, custom_hash)
    text = str(kvblocks.vllm.status())
    assert "mode=all" in text
    assert "hasher on sha256" in text
    reason = _state.Reason.HASH_FN.text
    assert f"\n  fallback x2: hasher: {reason}" in text, text


# An explicit install()/uninstall() wins over the plugin entry point.


def test_explicit_uninstall_wins_over_the_entry_point(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After uninstall() in a notebook, the first engine's plugin loading installs nothing,
    and says so once."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("KVBLOCKS_VLLM", "all")
    kvblocks.vllm.uninstall()
    _state._logged.clear()
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        load_plugins(monkeypatch)
        load_plugins(monkeypatch)
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    assert kvblocks.vllm.status().mode == "off"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "kvblocks: KVBLOCKS_VLLM=all not applied: install()/uninstall() chose mode=off in this "
        "process"
    ]


def test_explicit_install_wins_over_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("KVBLOCKS_VLLM", "all")
    kvblocks.vllm.install("hasher")
    load_plugins(monkeypatch)
    assert kvblocks.vllm.status().mode == "hasher"
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS
    assert scheduler_module.KVCacheManager is VllmKVCacheManager  # "all" was not installed
    # An explicit install() still replaces an explicit install().
    kvblocks.vllm.install("all")
    assert scheduler_module.KVCacheManager is not VllmKVCacheManager


# One part failing to install leaves the others, and says why.


def test_a_part_that_fails_to_install_falls_back_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The manager part's import fails (as if vLLM's scheduler module moved): the hasher
    stays installed, vLLM's scheduler is untouched, and status() names the error."""
    monkeypatch.delattr(kvblocks.vllm, "scheduler")
    monkeypatch.setitem(sys.modules, "kvblocks.vllm.scheduler", None)  # its import raises
    monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    _state.fallbacks.clear()
    _state._logged.clear()
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        kvblocks.vllm.register()  # as vLLM loads it: never raises
    status = kvblocks.vllm.status()
    assert status.mode == "all"
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS
    assert scheduler_module.KVCacheManager is VllmKVCacheManager
    assert not getattr(scheduler_module.Scheduler.__init__, "__kvblocks_wrapped__", False)
    assert dict(_state.fallbacks) == {("kv_cache_manager", "guard_error"): 1}
    (text,) = status.fallbacks
    assert text.startswith("kv_cache_manager: ")
    assert "(ModuleNotFoundError: import of kvblocks.vllm.scheduler halted" in text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "kv_cache_manager falls back" in warnings[0]
    assert "ModuleNotFoundError" in warnings[0]


def test_a_part_failing_halfway_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hasher part fails after it replaced kv_cache_utils' factory (the engine-core
    module cannot be patched): that replacement is undone, the manager part stays."""
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", SimpleNamespace())
    _state.fallbacks.clear()
    status = kvblocks.vllm.install("all")
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    assert scheduler_module.KVCacheManager is not VllmKVCacheManager
    assert "hasher" not in status.active
    assert dict(_state.fallbacks) == {("hasher", "guard_error"): 1}
    (text,) = status.fallbacks
    assert "(AttributeError: " in text


def test_import_kvblocks_does_not_import_vllm() -> None:
    code = "import sys, kvblocks, kvblocks.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fresh_process_with_engine_core(tmp_path: Path) -> None:
    """In a new process, as in an engine-core process: vLLM imports EngineCore (binding the
    name), then loads plugins; the bound name is replaced too, and status() says "not
    loaded yet" only before."""
    code = (
        "import vllm.v1.engine.core as core\n"
        "import kvblocks.vllm\n"
        "print(kvblocks.vllm.status().pending_mode)\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print(core.get_request_block_hasher.__module__)\n"
        "print(kvblocks.vllm.status().mode, kvblocks.vllm.status().pending_mode)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KVBLOCKS_VLLM", "VLLM_PLUGINS")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["all", OURS, "all", "None"]


# Whole scheduler runs: identical SchedulerOutputs with the plugin on and off.


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("num_blocks", [40, 400])
def test_scheduler_run_identical_with_plugin(model_dir: Path, algo: str, num_blocks: int) -> None:
    """``test_kv_cache_manager``'s comparison (which also checks that the plugin's hasher
    and manager ran) on longer prompts and a larger token budget; nothing falls back."""
    spec = SchedulerSpec(
        block_size=8, num_blocks=num_blocks, hash_algo=algo, max_num_batched_tokens=256
    )
    script = shared_prefix_script(
        spec, 40, 1, vocab=VOCAB_SIZE, prefix_lens=(20, 90), suffix_lens=(1, 40), arrival_steps=20
    )
    stock, ours = both(model_dir, script, seed="7")
    assert len(stock) > 20
    assert_same(stock, ours)
    if num_blocks == 40:  # the small pool must have preempted someone
        assert any(step[0][5] for step in stock[:-1])


BENCH_ARGV = ["bench", "--engine", "vllm", "--num-requests", "12", "--prefix-len", "40"]
BENCH_ARGV += ["--suffix-len", "9", "--output-len", "5", "--rounds", "1", "--num-blocks", "256"]


def test_kvblocks_bench_engine_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    from kvblocks.cli import main

    _state.fallbacks.clear()
    with scheduler_only_cpu_platform():
        # 16-token blocks, which vLLM's CPU backend warns about at every run (0.34's default
        # block size, 64, it does not)
        assert main([*BENCH_ARGV, "--block-size", "16"]) == 0
    assert dict(_state.fallbacks) == {}  # the kvblocks side ran on kvblocks throughout
    out, err = capsys.readouterr()
    # vLLM's warnings, repeated at every run, are summed up after the progress bar, and
    # kvblocks' own INFO lines are shown there.
    repeated = [line for line in err.splitlines() if "CPU backend prefers block_size" in line]
    assert len(repeated) == 2, err  # once at start-up, once after the bar with its count
    assert repeated[1].endswith(" times)"), repeated
    assert "INFO [vllm.kvblocks] kvblocks: installed into vLLM" in err
    assert "KV-cache layout llama: 1 group (full attention), 256 blocks (256 per group)" in out
    assert "stock" in out
    assert "with kvblocks" in out
    assert "scheduler outputs: identical in every run" in out
    assert "allocate_slots" in out
    assert kvblocks.vllm.status().mode == "off"  # the comparison leaves vLLM as it was


def test_cli_layouts_are_the_drivers() -> None:
    """``kvblocks bench --layout`` offers exactly the driver's layouts, in its order."""
    from kvblocks.cli import VLLM_LAYOUTS

    assert tuple(LAYOUTS) == VLLM_LAYOUTS


@pytest.mark.parametrize(
    ("layout", "groups"),
    [
        ("gpt-oss", "2 groups (full attention + sliding window 128), 256 blocks"),
        ("gemma3", "6 groups (5 x sliding window 1024 + full attention), 768 blocks"),
    ],
)
def test_kvblocks_bench_engine_vllm_layout(
    capsys: pytest.CaptureFixture[str], layout: str, groups: str
) -> None:
    """A tiny run on a layout of several groups: the header names the layout, its groups
    and the pool (128 blocks per group); kvblocks' manager ran and matched vLLM's. The
    200-token requests outgrow gpt-oss's 128-token window."""
    from kvblocks.cli import main

    _state.fallbacks.clear()
    argv = ["bench", "--engine", "vllm", "--layout", layout, "--num-requests", "8"]
    argv += ["--prefix-len", "160", "--suffix-len", "40", "--output-len", "4", "--rounds", "1"]
    with scheduler_only_cpu_platform():
        assert main([*argv, "--num-blocks", "128"]) == 0
    out = capsys.readouterr().out
    assert f"KV-cache layout {layout}: {groups} (128 per group)" in out
    # vLLM's own default block size (16 on 0.33, 64 on 0.34), as a model that names none gets
    assert f"block size {CacheConfig.DEFAULT_BLOCK_SIZE}," in out
    assert "scheduler outputs: identical in every run" in out
    assert dict(_state.fallbacks) == {}


def test_kvblocks_bench_engine_vllm_device_ms(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device-ms``: vLLM's engine-core loop on both sides, replayed against each device
    step, one row per step. At a 40 ms step the device bounds the rate: 16 running requests
    make at most 16 tokens per step of 40 ms and 16 us, and with every request's 64 tokens
    in about 66 steps (the prompts' two, then decodes) the rate is within a tenth of it."""
    from kvblocks.cli import main

    _state.fallbacks.clear()
    argv = ["bench", "--engine", "vllm", "--device-ms", "2,40", "--num-requests", "16"]
    with scheduler_only_cpu_platform():
        assert main([*argv, "--rounds", "1"]) == 0
    assert dict(_state.fallbacks) == {}
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| shared prefix | 16 | on |")]
    assert [row.split("|")[4].strip() for row in rows] == ["2 ms", "40 ms"], out
    bound = 16 / (0.040 + 16e-6)
    for side in rows[1].split("|")[5].split("->"):
        assert 0.9 * bound < float(side.replace(",", "")) <= bound, rows[1]
    assert "outputs: identical token for token" in out
    assert kvblocks.vllm.status().mode == "off"


@pytest.mark.parametrize("part", ["kv_cache_manager", "hasher"])
def test_kvblocks_bench_engine_vllm_fails_when_kvblocks_did_not_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """Were a part to fall back, "with kvblocks" would be stock vLLM: no report, an error."""
    from kvblocks.cli import main
    from kvblocks.vllm import block_hasher as block_hasher_module
    from kvblocks.vllm import scheduler

    if part == "kv_cache_manager":
        refuse = lambda *args, **kwargs: _state.Reason.KV_CONNECTOR  # noqa: E731
        monkeypatch.setattr(scheduler, "unsupported_config", refuse)
        ran = "manager vllm.v1.core.kv_cache_manager, hasher kvblocks.vllm.block_hasher"
        reason = _state.Reason.KV_CONNECTOR.text
    else:
        monkeypatch.setattr(block_hasher_module, "_hash_function_names", dict)
        ran = "manager kvblocks.vllm.kv_cache_manager, hasher vllm.v1.core.kv_cache_utils"
        reason = _state.Reason.HASH_FN.text
    with scheduler_only_cpu_platform():
        assert main(BENCH_ARGV) == 2
    out, err = capsys.readouterr()
    assert "scheduler-side CPU time" not in out
    assert (
        "kvblocks: error: the 'with kvblocks' side of the comparison did not run on kvblocks "
        f"(ran on {ran}; fell back to vLLM's code: {part}: {reason})"
    ) in err
    assert kvblocks.vllm.status().mode == "off"
