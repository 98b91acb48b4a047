"""How to install an optional part of kvblocks, as every hint the package prints says it."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The command that installs the extra ``extra`` today. kvblocks is not on PyPI yet, so
    the extra is installed from a checkout of the repository."""
    return f'pip install ".[{extra}]" in a kvblocks checkout'
