"""The web page as a user meets it: how fast it loads, whether watching the cluster slows decoding,
and the README's screenshots.

    python -m benchmarks.webui [--model PATH] [--rounds 6] [--tokens 128] [--screenshots DIR]

Two workers (one thread each, pinned) and `shardwire serve --rpc w1,w2` as a user runs them, the
page in headless Chromium (Debian's chromium, driven by Playwright) on the same machine. Decode
speed: llama-server's /completion, greedy, --tokens tokens, its `timings.predicted_per_second`;
rounds alternate between nothing watching, the cluster feed (GET /v1/cluster/events) read by a
client without a browser (what serving the feed costs the server), and the page open on the
cluster view (that, and the browser drawing each snapshot on the same machine), so that drift in
the machine's speed falls on all three.
Load: the browser's navigation timing of / (loadEventEnd), the first load and a reload (the
page's files cached by content hash). With --screenshots, the chat after one reply and the
cluster view, as PNG files in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import urllib.request
from pathlib import Path

from shardwire_kit.browser import launch

from . import run
from .prefix_cache import Cluster

HERE = Path(__file__).resolve().parent
PROMPT = "Alice was beginning to get very tired of sitting by her sister on the bank, and"


MODES = {
    "none": "nothing watching",
    "feed": "the cluster feed read by a client without a browser",
    "page": "the page open on the cluster view",
}


class Feed:
    """GET /v1/cluster/events read on a thread, as a page would read it, without a browser."""

    def __init__(self, port: int):
        self.response = urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/cluster/events", timeout=60)
        self.events = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.response:
                self.events += line.startswith(b"event: ")
        except (OSError, ValueError, AttributeError):
            pass  # closed by __exit__ while reading

    def __enter__(self) -> "Feed":
        return self

    def __exit__(self, *exc) -> None:
        self.response.close()


def decode_speed(port: int, tokens: int) -> float:
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())["timings"]["predicted_per_second"]


def load_ms(page) -> float:
    return json.loads(page.evaluate("JSON.stringify(performance.getEntriesByType('navigation')[0])"))["loadEventEnd"]


def screenshots(page, port: int, folder: Path) -> None:
    """The chat after one reply; the cluster view while a request decodes (its live figures)."""
    url = f"http://127.0.0.1:{port}"
    folder.mkdir(parents=True, exist_ok=True)
    page.goto(url + "/#chat")
    page.get_by_test_id("settings").locator("summary").click()
    page.get_by_test_id("setting-max_tokens").fill("48")
    page.get_by_test_id("setting-temperature").fill("0")
    page.get_by_test_id("settings").locator("summary").click()
    page.get_by_test_id("prompt").fill("Who did Alice meet at the tea party?")
    page.get_by_test_id("send").click()
    page.locator('[data-role="assistant"] [data-testid="stats"]').first.wait_for(timeout=120_000)
    page.screenshot(path=str(folder / "webui-chat.png"))
    page.get_by_test_id("tab-cluster").click()
    page.wait_for_function("() => document.querySelectorAll('[data-testid=worker][data-state=healthy]').length >= 2")
    decoding = threading.Thread(target=decode_speed, args=(port, 96))
    decoding.start()
    try:
        page.wait_for_function(
            "() => parseFloat(document.querySelector('[data-testid=stat-tokens] .stat-value')?.innerText) > 0",
            timeout=30_000,
        )
        page.set_viewport_size({"width": 1280, "height": 1150})  # the view scrolls inside the page: all of it
        page.screenshot(path=str(folder / "webui-cluster.png"))
        page.set_viewport_size({"width": 1280, "height": 860})
    finally:
        decoding.join()


def main() -> int:
    run.private_state_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: glassllm, as the demo runs it)")
    p.add_argument("--rounds", type=int, default=6, help="decode measurements with the page open, and as many without")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--screenshots", type=Path, default=None, help="save the chat and cluster views here")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    if args.model is None:
        from shardwire_kit.glassllm import cached_glassllm_gguf

        args.model = cached_glassllm_gguf()
    log = Path(tempfile.mkdtemp(prefix="shardwire-webui-")) / "processes.log"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; model {args.model.name}; 2 workers, 1 thread each; processes' output: {log}")
    cluster = Cluster(HERE.parent, args.model, log, ["-np", "2", "-c", "1024", "--chat-template", "chatml"])
    url = f"http://127.0.0.1:{cluster.port}"
    try:
        with sync_playwright() as playwright:
            browser = launch(playwright)
            if browser is None:
                raise SystemExit("no Chromium on this machine (Debian: apt-get install chromium)")
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.goto(url + "/")
            first = load_ms(page)
            page.reload()
            again = load_ms(page)
            print(f"page load (navigation to load event): first {first:.0f} ms, reload {again:.0f} ms")
            if args.screenshots:
                screenshots(page, cluster.port, args.screenshots)
                print(f"screenshots in {args.screenshots}")
            decode_speed(cluster.port, 16)  # warm: graphs built, caches touched
            speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
            for i in range(args.rounds):
                for mode in list(MODES) if i % 2 == 0 else list(MODES)[::-1]:
                    page.goto(url + "/#cluster" if mode == "page" else "about:blank")
                    if mode == "page":
                        page.get_by_test_id("worker").first.wait_for()
                    with Feed(cluster.port) if mode == "feed" else contextlib.nullcontext():
                        speeds[mode].append(decode_speed(cluster.port, args.tokens))
            browser.close()
    finally:
        cluster.stop()
    for mode, values in speeds.items():
        print(
            f"decode, {MODES[mode]}: median {statistics.median(values):.1f} tokens/s "
            f"(min {min(values):.1f}, max {max(values):.1f}, {len(values)} rounds of {args.tokens} tokens)"
        )
    none = statistics.median(speeds["none"])
    print(
        f"against none (medians): the feed read {statistics.median(speeds['feed']) / none:.3f}x, "
        f"the page open {statistics.median(speeds['page']) / none:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
