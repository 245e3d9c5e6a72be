"""Where the tests find the repository and the shared folder beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent  # the tests' shared helpers
REPO = SUPPORT.parents[1]


SHARED = Path(os.environ.get("SHARDWIRE_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """A file under ../shared, or a clean skip when this checkout has none."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared folder beside the checkout)")
    return path
