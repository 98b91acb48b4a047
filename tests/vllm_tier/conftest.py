"""The test tier against the real vllm wheels, on the CPU.

Collected only where vllm can be imported, except that ``KVBLOCKS_REQUIRE_VLLM=1`` (set by
``.ci/run``) turns a missing vllm into a failure instead of a skip. ``KVBLOCKS_EXPECT_VLLM``
(set by ``.ci/run`` where it runs tier files against vLLM 0.34) names the version the run
must find, so that a run meant for one release cannot pass on another."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The PyPI wheel is a CUDA build; without this VllmConfig cannot infer a device here.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if os.environ.get("KVBLOCKS_REQUIRE_VLLM") != "1":
    pytest.importorskip(
        "vllm", reason="the vLLM tier needs vllm (.ci/run installs it: docs/vllm.md#the-test-tier)"
    )

import kvblocks.vllm
from kvblocks.vllm import _state
from kvblocks.vllm.versions import installed_vllm_version
from tests.vllm_driver import write_model_dir
from tests.vllm_driver.porting import open_guard_if_asked

# PORTING AID, TEST ONLY: KVBLOCKS_PORTING_OPEN=1 runs every part on the installed vLLM.
open_guard_if_asked()

_EXPECTED = os.environ.get("KVBLOCKS_EXPECT_VLLM")
if _EXPECTED and installed_vllm_version() != _EXPECTED:
    raise RuntimeError(
        f"KVBLOCKS_EXPECT_VLLM={_EXPECTED}, but the vllm found is {installed_vllm_version()}"
    )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def _unpatched() -> None:
    """vLLM's own code in place, and no explicit install()/uninstall() remembered: the
    plugin entry point (register) installs what KVBLOCKS_VLLM says, as in a new process.
    Nothing counted or logged once before is remembered either (fallbacks, their details,
    the log-once memory), so no test sees another's."""
    kvblocks.vllm.uninstall()
    _state.explicit = False
    _state.fallbacks.clear()
    _state.details.clear()
    _state._logged.clear()


@pytest.fixture(autouse=True)
def _vllm_unpatched() -> Iterator[None]:
    """Every test starts and ends with vLLM's own code in place; and no allocation of
    kvblocks' manager in this process failed its check during the test (inside vLLM a failed
    check finishes the request with an error instead of raising: ``contained_errors``, which
    only the fault tests, in processes of their own, may move)."""
    _unpatched()
    contained = _state.contained_errors
    yield
    _unpatched()
    assert _state.contained_errors == contained, "an allocation failed kvblocks' check"


@pytest.fixture(params=[False, True])
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    """Each test that takes it runs with the synchronous scheduler and with async scheduling
    (``AsyncScheduler``, model outputs one step late)."""
    value: bool = request.param
    return value
