"""Fixtures shared by the tests: both implementations as a parameter."""

from __future__ import annotations

from types import ModuleType

import pytest

import kvblocks
import kvblocks.reference


@pytest.fixture(params=["native", "reference"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module under test: ``kvblocks`` (Rust) or ``kvblocks.reference`` (Python)."""
    return kvblocks if request.param == "native" else kvblocks.reference
