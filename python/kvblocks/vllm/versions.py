"""The vLLM releases kvblocks reproduces, and what kvblocks says about any other one.

A leaf of :mod:`kvblocks.vllm` (it imports only :mod:`kvblocks.vllm._state`): the plugin, the
scheduler hook, the fingerprints and ``kvblocks bench --engine vllm`` all ask it, and all look
the installed version up through :func:`installed_vllm_version` at call time (tests replace
that one function to play another release).
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

import kvblocks.vllm._state as _state
from kvblocks.vllm._state import Reason

#: The vLLM releases this version of kvblocks supports: ``>= 0.33, < 0.35``. Which of its
#: parts run on each is in the release's fingerprint file (kvblocks.vllm.fingerprints).
SUPPORTED_VLLM = ((0, 33), (0, 35))


def installed_vllm_version() -> str | None:
    """The installed vllm distribution's version, or None without one (vLLM is not
    imported)."""
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def _supported(version: str) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return False
    low, high = SUPPORTED_VLLM
    return low <= (int(match[1]), int(match[2])) < high


def supported_range() -> str:
    """:data:`SUPPORTED_VLLM` as a pip requirement's specifier: ``>=0.33,<0.35``."""
    low, high = (".".join(map(str, v)) for v in SUPPORTED_VLLM)
    return f">={low},<{high}"


def unsupported_vllm(version: str | None) -> str | None:
    """Why kvblocks leaves vLLM ``version`` alone (None when it supports it), with what to
    do: the log line of the plugin and of ``--scheduler-cls kvblocks.vllm.Scheduler``, and
    what ``kvblocks bench --engine vllm`` says."""
    if version is None:
        from kvblocks._install import install_hint

        return f"vLLM is not installed: {install_hint('vllm')}"
    if _supported(version):
        return None
    from kvblocks import __version__

    return (
        f"kvblocks {__version__} supports vllm{supported_range()}, not vllm {version}: "
        f"{_version_remedy(version)}"
    )


def _version_remedy(version: str) -> str:
    return (
        f"to use kvblocks, install a kvblocks release that supports vllm {version}, "
        f'or pip install "vllm{supported_range()}"'
    )


def version_fallback(part: str, version: str) -> None:
    """Records that ``part`` leaves vLLM ``version`` alone because kvblocks does not support
    that release (``status()`` lists it; the caller logs the one line)."""
    detail = f"vllm {version}; {_version_remedy(version)}"
    _state.fall_back(part, Reason.VLLM_VERSION, detail, quiet=True)
