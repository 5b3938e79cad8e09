"""Shared fixtures."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted smollm2-135m registry model, pulled into the cache on first use (about 100 MB)."""
    from specdec_core.models.registry import pull

    return pull("smollm2-135m")
