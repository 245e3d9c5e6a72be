"""The folder where this machine keeps what must outlive a run but is no cache: its worker
certificate and its coordinators' known hosts."""

from __future__ import annotations

import os
from pathlib import Path

STATE_ENV = "SHARDWIRE_STATE_DIR"


def state_dir() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "shardwire"
