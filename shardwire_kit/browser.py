"""Headless Chromium on a machine that may have no internet, as the web page's tests and
benchmarks start it: Debian's chromium (or SHARDWIRE_CHROMIUM), with nothing it would fetch for
itself, driven by Playwright."""

from __future__ import annotations

import os
import shutil

CHROMIUM_FLAGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    return os.environ.get("SHARDWIRE_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )


def launch(playwright):
    """A headless Chromium from a running sync_playwright(); None where none is installed."""
    executable = chromium_path()
    if executable is None:
        return None
    return playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
