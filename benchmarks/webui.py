"""The web page as a user meets it: how fast it loads, whether watching the cluster slows decoding,
and the README's screenshots.

    python -m benchmarks.webui [--model PATH] [--rounds 6] [--tokens 128] [--screenshots DIR]

Two workers (one thread each, pinned) and `shardwire serve --rpc w1,w2` as a user runs them, the
page in headless Chromium (Debian's chromium, driven by Playwright) on the same machine. Decode
speed: llama-server's /completion, greedy, --tokens tokens, its `timings.predicted_per_second`;
rounds alternate between no page open and the page open on the cluster view (the view that
receives the server's pushed snapshots), so that drift in the machine's speed falls on both.
Load: the browser's navigation timing of / (loadEventEnd), the first load and a reload (the
page's files cached by content hash). With --screenshots, the chat after one reply and the
cluster view, as PNG files in DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import urllib.request
from pathlib import Path

from shardwire_kit.browser import launch

from . import run
from .prefix_cache import Cluster

HERE = Path(__file__).resolve().parent
PROMPT = "Alice was beginning to get very tired of sitting by her sister on the bank, and"


def decode_speed(port: int, tokens: int) -> float:
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())["timings"]["predicted_per_second"]


def load_ms(page) -> float:
    return json.loads(page.evaluate("JSON.stringify(performance.getEntriesByType('navigation')[0])"))["loadEventEnd"]


def screenshots(page, url: str, folder: Path) -> None:
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
    page.wait_for_timeout(1500)  # a live figure or two
    page.screenshot(path=str(folder / "webui-cluster.png"))


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
                screenshots(page, url, args.screenshots)
                print(f"screenshots in {args.screenshots}")
            decode_speed(cluster.port, 16)  # warm: graphs built, caches touched
            speeds: dict[str, list[float]] = {"no page": [], "cluster view open": []}
            for i in range(args.rounds):
                for watching in (False, True) if i % 2 == 0 else (True, False):
                    if watching:
                        page.goto(url + "/#cluster")
                        page.get_by_test_id("worker").first.wait_for()
                    else:
                        page.goto("about:blank")
                    speeds["cluster view open" if watching else "no page"].append(
                        decode_speed(cluster.port, args.tokens)
                    )
            browser.close()
    finally:
        cluster.stop()
    none, watched = speeds["no page"], speeds["cluster view open"]
    for name, values in speeds.items():
        print(
            f"decode, {name}: median {statistics.median(values):.1f} tokens/s "
            f"(min {min(values):.1f}, max {max(values):.1f}, {len(values)} rounds of {args.tokens} tokens)"
        )
    print(f"watching / none: {statistics.median(watched) / statistics.median(none):.3f}x (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
