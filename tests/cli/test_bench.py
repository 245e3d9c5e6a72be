"""`shardwire bench`, the benchmark's link relay (benchmarks/relay.py), its report
(benchmarks/report.py) and the product benchmark (benchmarks/products.py)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest

from benchmarks import report
from benchmarks.relay import Relay, Shaping

from models import model_path

pytestmark = pytest.mark.slow  # worker processes


def _echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return

            def run(c=c):
                while data := c.recv(1 << 16):
                    c.sendall(data)
                c.close()

            threading.Thread(target=run, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def _round_trip(port: int, size: int = 100) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(b"x" * size)
        got = 0
        while got < size:
            got += len(s.recv(1 << 16))
        return time.perf_counter() - t0


def test_relay_delays_counts_and_caps():
    srv = _echo_server()
    relay = Relay(srv.getsockname()[:2], shaping=Shaping(delay_s=0.005))
    try:
        rtt = min(_round_trip(relay.port) for _ in range(3))
        assert 0.010 <= rtt < 0.1  # two one-way delays of 5 ms
        assert relay.counter.up == relay.counter.down == 300
        relay.shaping = Shaping(rate=1e6)  # 1 MB/s: 100 kB each way takes at least 0.1 s
        assert _round_trip(relay.port, 100_000) >= 0.1
        relay.shaping.enabled = False
        assert _round_trip(relay.port) < 0.01
    finally:
        relay.close()
        srv.close()


def test_relay_refuses_other_addresses():
    with pytest.raises(ValueError, match="loopback"):
        Relay(("192.0.2.1", 80))


def test_bench_single_process(capsys):
    from shardwire.cli.main import main

    path = model_path("llama", "F32")
    assert main(["bench", str(path), "-p", "16", "-n", "4", "-r", "2", "-t", "1", "--streams", "2", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tests = {t["test"]: t for t in report["tests"]}
    assert set(tests) == {"pp16", "tg4", "tg4x2"}
    assert all(len(t["samples_ns"]) == 2 and t["avg_ts"] > 0 for t in tests.values())
    assert report["peak_rss"] > 0 and report["workers"] == []
    from shardwire.weights import ggml_cpu
    from shardwire.weights.in_use import compute_line
    from shardwire.weights.measure import fastest_formats

    assert report["compute"] == [f"kernels on cpu: {compute_line('cpu')}"]
    fastest = fastest_formats("cpu", "float32")["F32"]  # whichever format this machine measured fastest
    if fastest == "dense":
        assert report["formats"] == ["float32 activations (float32:dense)"]
    else:  # with whose product took the F32 prompt chunks, as measured here (none takes one F32 row)
        whose = "shardwire" if "F32" in ggml_cpu.own_products_used() else "ggml"
        suffix = f"/{whose}-gemm" if "F32" in ggml_cpu.own_products() else ""
        assert report["formats"] == [f"float32 activations (F32:{fastest}{suffix})"]


def test_the_report_gives_the_ratio_of_each_interleaved_pair_of_invocations():
    """A cell's ratio is of the medians over every invocation; beside it, each invocation of
    shardwire against llama.cpp's of the same alternation (rep), so that drift across the run shows
    as a spread and a difference that holds shows in every pair. A failed invocation pairs with none."""

    def run(system, rep, pp_ms, tg_ms, ok=True):
        return {
            "system": system,
            "cell": "m/w0/local",
            "rep": rep,
            "ok": ok,
            "n_prompt": 64,
            "n_gen": 32,
            "pp_ns": [int(x * 1e6) for x in pp_ms],
            "tg_ns": [int(x * 1e6) for x in tg_ms],
        }

    runs = [
        run("llama.cpp", 0, [100, 110, 90], [200, 200]),
        run("shardwire", 0, [50, 50, 60], [250, 250]),
        run("shardwire", 1, [90, 90, 90], [100, 100]),
        run("llama.cpp", 1, [90, 99, 80], [100, 100]),
        run("llama.cpp", 2, [10, 10, 10], [10, 10], ok=False),
        run("shardwire", 2, [10, 10, 10], [10, 10]),
    ]
    cell = {"key": "m/w0/local", "workload": "m", "workers": 0, "link": "local"}
    entry = report.summarize({"cells": [cell], "runs": runs})["cells"]["m/w0/local"]
    assert entry["pair_ratios"] == {"pp": [2.0, 1.0], "tg": [0.8, 1.0]}


@pytest.mark.parametrize("rows,kind", [(1, "gemv"), (64, "gemm")])
def test_the_product_benchmark_times_both_kernels_and_names_the_cpu(capsys, monkeypatch, rows, kind):
    from benchmarks import products
    from shardwire.weights import ggml_cpu

    used = ggml_cpu.own_products_used(kind)
    monkeypatch.setattr(sys, "argv", ["products.py", "--rows", str(rows), "--gbytes", "0.02", "--rounds", "2"])
    assert products.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and f"rows: {rows}" in out
    for stored in ggml_cpu.own_products(kind):
        assert f"{stored} shardwire (kernels/" in out and f"{stored} ggml " in out and " GFLOP/s " in out
        assert f"{stored} shardwire / ggml: " in out
    assert ggml_cpu.own_products_used(kind) == used
