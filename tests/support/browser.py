"""Headless Chromium driven by Playwright, for the web page's tests: the `browser` fixture (one
per test module: Playwright's sync API holds an event loop on the main thread while it runs,
which later tests' asyncio.run() refuses), `page` (a fresh one per test) and a screenshot of
the page of each test that fails, saved to SCREENSHOTS (its path printed in the report).
Skipped, saying why, where Playwright or a Chromium is missing (.ci/run installs both)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from shardwire_kit.browser import launch

SCREENSHOTS = Path(os.environ.get("SHARDWIRE_SCREENSHOTS", Path(tempfile.gettempdir()) / "shardwire-screenshots"))


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as playwright:
        launched = launch(playwright)
        if launched is None:
            pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
        yield launched
        launched.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 860})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda e: errors.append(str(e)))
    opened.errors = errors
    yield opened
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{request.node.name}.png"
        opened.screenshot(path=str(path), full_page=True)
        report.sections.append(("screenshot", str(path)))
        print(f"screenshot of the failed page: {path}")
    context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item.report_call = outcome.get_result()
