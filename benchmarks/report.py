"""Figures, the markdown table and the plot of a benchmark run, from its results.json.

python -m benchmarks.report benchmarks/results/quick-.../results.json   # re-render
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SYSTEMS = ("llama.cpp", "shardwire")
COLORS = {"llama.cpp": "#d9822b", "shardwire": "#2b6cd9"}
MIB = 2**20


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _cell_stats(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return {"ok": False, "error": next((r.get("error") for r in runs if r.get("error")), "no run")}
    n_prompt, n_gen = ok[0]["n_prompt"], ok[0]["n_gen"]
    pp = [n_prompt / (s / 1e9) for r in ok for s in r["pp_ns"]]
    tg = [n_gen / (s / 1e9) for r in ok for s in r["tg_ns"]]
    st = {
        "ok": True,
        "runs": len(ok),
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "pp_ts": _median(pp),
        "tg_ts": _median(tg),
        "pp_ts_range": [min(pp), max(pp)] if pp else None,
        "tg_ts_range": [min(tg), max(tg)] if tg else None,
        "ttft_ms": _median([s / 1e6 for r in ok for s in r["pp_ns"]]),
        "tg_bytes_per_token": _median([r.get("tg_bytes_per_token") for r in ok]),
        "pp_bytes": _median([r.get("pp_bytes") for r in ok]),
        "coordinator_rss": max((r.get("coordinator_rss") or 0) for r in ok),
        "worker_rss": ok[0].get("worker_rss") or {},
        "streams_ts": _median([x for r in ok for x in r.get("streams_ts", [])]),
        "streams": max(r.get("streams", 0) for r in ok),
        "formats": ok[0].get("formats") or [],
    }
    by_delay: dict[str, list] = {}
    for r in ok:
        for d, ns in zip(r.get("sweep_delays") or [], r["tg_ns"]):
            by_delay.setdefault(f"{d:g}", []).append(n_gen / (ns / 1e9))
    if by_delay:
        st["sweep"] = {d: _median(v) for d, v in by_delay.items()}
        st["sweep_samples"] = by_delay
        # paired: each delayed run against the 0 ms run just before it, in the same invocation
        pairs: dict[str, list] = {}
        for r in ok:
            last0 = None
            for d, ns in zip(r.get("sweep_delays") or [], r["tg_ns"]):
                ms = ns / 1e6 / n_gen
                if d == 0:
                    last0 = ms
                elif last0 is not None:
                    pairs.setdefault(f"{d:g}", []).append(ms - last0)
        st["sweep_added_ms"] = {d: _median(v) for d, v in pairs.items()}
    relays = [r["relay_bytes_per_token"] for r in ok if r.get("relay_bytes_per_token")]
    if relays:
        st["relay_bytes_per_token"] = {
            k: {d: _median([x[k][d] for x in relays]) for d in ("up", "down")} for k in relays[0]
        }
    st["total_rss"] = st["coordinator_rss"] + sum(v or 0 for v in st["worker_rss"].values())
    return st


def _pair_ratios(llama: list[dict], ours: list[dict]) -> dict:
    """shardwire / llama.cpp for each interleaved pair of invocations (the two systems' runs of
    the same alternation, rep), prompt and decode: the spread says whether a cell's ratio is the
    machine's drift or a difference that holds in every pair."""
    theirs = {r["rep"]: r for r in llama if r.get("ok")}
    out: dict[str, list] = {"pp": [], "tg": []}
    for r in sorted((r for r in ours if r.get("ok") and r["rep"] in theirs), key=lambda r: r["rep"]):
        t = theirs[r["rep"]]
        for k in out:
            a, b = _median(t[f"{k}_ns"]), _median(r[f"{k}_ns"])
            if a and b:
                out[k].append(a / b)  # times: llama.cpp's over shardwire's is shardwire's speed over llama.cpp's
    return out


def _ratio(a, b):
    return a / b if a and b else None


def summarize(results: dict) -> dict:
    cells = {c["key"]: c for c in results["cells"]}
    by = {}
    for r in results["runs"]:
        by.setdefault((r["cell"], r["system"]), []).append(r)
    out = {"cells": {}, "efficiency": {}, "latency": {}, "targets": []}
    for key, cell in cells.items():
        entry = {"cell": cell, "systems": {}}
        for system in SYSTEMS:
            if (key, system) in by:
                entry["systems"][system] = _cell_stats(by[(key, system)])
        if (key, "harness") in by:
            entry["error"] = by[(key, "harness")][0].get("error")
        a, b = entry["systems"].get("llama.cpp", {}), entry["systems"].get("shardwire", {})
        if a.get("ok") and b.get("ok"):
            entry["ratio"] = {
                "pp": _ratio(b["pp_ts"], a["pp_ts"]),
                "tg": _ratio(b["tg_ts"], a["tg_ts"]),
                "ttft": _ratio(b["ttft_ms"], a["ttft_ms"]),
                "bytes_per_token": _ratio(b.get("tg_bytes_per_token"), a.get("tg_bytes_per_token")),
                "memory": _ratio(b["total_rss"], a["total_rss"]),
            }
            entry["pair_ratios"] = _pair_ratios(by[(key, "llama.cpp")], by[(key, "shardwire")])
        out["cells"][key] = entry
    workloads = list(dict.fromkeys(c["workload"] for c in cells.values()))

    def stat(workload, workers, link, system):
        e = out["cells"].get(f"{workload}/w{workers}/{link}", {}).get("systems", {}).get(system, {})
        return e if e.get("ok") else None

    for w in workloads:
        for system in SYSTEMS:
            single = stat(w, 0, "local", system)
            for k in (1, 2, 3):
                dist = stat(w, k, "direct", system)
                # the single process run beside this cell (same load), else the baseline cell
                paired = by.get((f"{w}/w{k}/direct-baseline", system))
                base = _cell_stats(paired) if paired else single
                if base and base.get("ok") and dist and base["tg_ts"] and dist["tg_ts"]:
                    out["efficiency"].setdefault(w, {}).setdefault(system, {})[k] = dist["tg_ts"] / base["tg_ts"]
                    if paired:
                        out["efficiency_baseline_tg_ts"] = out.get("efficiency_baseline_tg_ts", {})
                        out["efficiency_baseline_tg_ts"][f"{w}/w{k}/{system}"] = base["tg_ts"]
            for k in (1, 2, 3):
                # the sweep (delays alternated inside each invocation) where there is one, else the cells
                sweep = (stat(w, k, "sweep", system) or {}).get("sweep") or {}
                base_ts = sweep.get("0") or (stat(w, k, "0", system) or {}).get("tg_ts")
                if not base_ts:
                    continue
                for link in sorted((set(sweep) | {"0.2", "1"}) - {"0"}, key=float):
                    ts = sweep.get(link) or (stat(w, k, link, system) or {}).get("tg_ts")
                    if ts:
                        s = {"tg_ts": ts}
                        base = {"tg_ts": base_ts}
                        paired = ((stat(w, k, "sweep", system) or {}).get("sweep_added_ms") or {}).get(link)
                        added = paired if paired is not None else 1000 / s["tg_ts"] - 1000 / base["tg_ts"]
                        d = float(link)
                        row = {
                            "ms_per_token": 1000 / s["tg_ts"],
                            "base_ms_per_token": 1000 / base["tg_ts"],
                            "added_ms": added,
                            "equivalent_one_way_crossings": added / d,
                            "source": "sweep, paired runs" if paired is not None else "cells",
                        }
                        if system == "shardwire":
                            row["crossings"] = k + 1
                            row["bound_ms"] = (k + 1) * d * 1.1
                        out["latency"].setdefault(w, {}).setdefault(f"w{k}", {}).setdefault(link, {})[system] = row
    out["targets"] = _targets(out, workloads, stat)
    return out


def _targets(out, workloads, stat) -> list[dict]:
    t = []
    for w in workloads:
        e = out["cells"].get(f"{w}/w2/direct", {})
        r = (e.get("ratio") or {}).get("tg")
        need = 1.5 if w.startswith("small") else 1.0
        t.append(
            {
                "target": f"decode, 2 workers, loopback, {w}: shardwire / llama.cpp >= {need}",
                "measured": r,
                "met": None if r is None else r >= need,
            }
        )
    for w in workloads:
        eff = out["efficiency"].get(w, {})
        s, l = eff.get("shardwire", {}).get(2), eff.get("llama.cpp", {}).get(2)
        t.append(
            {
                "target": f"distributed efficiency, 2 workers, {w}: >= 0.9",
                "measured": s,
                "llama.cpp": l,
                "met": None if s is None else s >= 0.9,
            }
        )
    for w in workloads:
        row = out["latency"].get(w, {}).get("w2", {}).get("1", {})
        s, l = row.get("shardwire"), row.get("llama.cpp")
        if s:
            t.append(
                {
                    "target": f"added time per token at 1 ms one-way, 2 workers, {w}: <= 3 crossings x 1 ms + 10% "
                    f"= {s['bound_ms']:.1f} ms",
                    "measured": s["added_ms"],
                    "llama.cpp": l["added_ms"] if l else None,
                    # below the 3 ms that three 1 ms crossings must cost, the figure is noise, not a pass
                    "met": None if s["added_ms"] < 0.8 * s["crossings"] else s["added_ms"] <= s["bound_ms"],
                    "note": "below the physical minimum of 3 crossings x 1 ms: not resolved on this machine"
                    if s["added_ms"] < 0.8 * s["crossings"]
                    else None,
                }
            )
    for w in workloads:
        r = (out["cells"].get(f"{w}/w2/direct", {}).get("ratio") or {}).get("pp")
        if r is not None:
            t.append(
                {
                    "target": f"prompt, 2 workers, {w}: shardwire / llama.cpp (below 0.8 is a gap)",
                    "measured": r,
                    "met": r >= 0.8,
                }
            )
    for w in workloads:
        s = out["cells"].get(f"{w}/w2/direct", {}).get("systems", {}).get("shardwire", {})
        if s.get("ok") and s.get("streams_ts") and s.get("tg_ts"):
            r = s["streams_ts"] / s["tg_ts"]
            t.append(
                {
                    "target": f"{s['streams']} concurrent streams, 2 workers, {w}: aggregate >= 3x one stream",
                    "measured": r,
                    "met": r >= 3,
                }
            )
    return t


# ---------------------------------------------------------------------------------------------
# Markdown


def _f(x, fmt="{:.1f}", none="–"):
    return none if x is None else fmt.format(x)


def _link_label(cell) -> str:
    if cell["workers"] == 0:
        return "single process"
    link = {"direct": "loopback", "sweep": "relay, delay swept"}.get(cell["link"], f"relay {cell['link']} ms")
    return f"{cell['workers']} worker{'s' if cell['workers'] > 1 else ''}, {link}"


def markdown(results: dict) -> str:
    s = results["summary"]
    meta = results["meta"]
    m = meta["machine"]
    lines = [
        f"# shardwire vs llama.cpp RPC ({meta['mode']} run, {meta['started']})",
        "",
        f"{m.get('cpu')} · {m.get('cores')} cores · {m.get('memory_gib')} GiB · ggml {m.get('ggml', '?')} · "
        f"threads per process: "
        f"{meta['threads']} · relayed links capped at {meta['rate_gbit']} Gbit/s · each cell: "
        f"{meta['alternations']} invocations per system, interleaved, {meta['reps']} runs each; medians · "
        f"load average {', '.join(f'{x:.1f}' for x in m.get('load_avg_start', []))} at the start · "
        f"shardwire commit {m.get('commit', '?')}{' + local changes' if m.get('shardwire_tree_dirty') else ''}",
        "",
        f"Command: `{' '.join(meta['argv'])}`",
        "",
        "## Targets",
        "",
        "| target | shardwire | llama.cpp | met |",
        "| --- | ---: | ---: | :---: |",
    ]
    for t in s["targets"]:
        met = (t.get("note") or "–") if t["met"] is None else ("yes" if t["met"] else "**no**")
        unit = " ms" if "added time" in t["target"] else ""
        lines.append(
            f"| {t['target']} | {_f(t['measured'], '{:.2f}')}{unit if t['measured'] is not None else ''} | "
            f"{_f(t.get('llama.cpp'), '{:.2f}')}{unit if t.get('llama.cpp') is not None else ''} | {met} |"
        )
    for w, info in meta["models"].items():
        cells = [e for e in s["cells"].values() if e["cell"]["workload"] == w]
        if not cells:
            continue
        lay = info["layout"]
        types = ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in info["tensor_types"].items())
        c0 = cells[0]["cell"]
        lines += [
            "",
            f"## {w}",
            "",
            f"{lay['n_layers']} blocks, width {lay['dim']}, FFN {lay['ffn_dim']}, {lay['n_heads']}/"
            f"{lay['n_kv_heads']} heads, vocab {lay['vocab_size']}; {info['bytes'] / MIB:.0f} MiB ({types}). "
            f"pp{c0['n_prompt']}, tg{c0['n_gen']}. Ratios are shardwire / llama.cpp (TTFT: lower is better).",
            "",
            "| setup | prompt t/s llama.cpp | shardwire | ratio | decode t/s llama.cpp | shardwire | ratio | "
            "TTFT ms llama.cpp | shardwire | bytes/decode step llama.cpp | shardwire | peak MiB llama.cpp | "
            "shardwire |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in cells:
            if e["cell"]["link"] == "sweep":  # shown in the latency table below
                continue
            a, b = e["systems"].get("llama.cpp", {}), e["systems"].get("shardwire", {})
            r = e.get("ratio") or {}

            def v(st, k, fmt="{:.1f}"):
                return _f(st.get(k), fmt) if st.get("ok") else ("failed" if st else "–")

            def mem(st):
                if not st.get("ok"):
                    return "–"
                workers = [x for x in st["worker_rss"].values() if x]
                text = f"{st['coordinator_rss'] / MIB:.0f}"
                return text + (" + " + " + ".join(f"{x / MIB:.0f}" for x in workers) if workers else "")

            lines.append(
                f"| {_link_label(e['cell'])} | {v(a, 'pp_ts')} | {v(b, 'pp_ts')} | {_f(r.get('pp'), '{:.2f}x')} | "
                f"{v(a, 'tg_ts', '{:.2f}')} | {v(b, 'tg_ts', '{:.2f}')} | **{_f(r.get('tg'), '{:.2f}x')}** | "
                f"{v(a, 'ttft_ms', '{:.0f}')} | {v(b, 'ttft_ms', '{:.0f}')} | "
                f"{v(a, 'tg_bytes_per_token', '{:.0f}')} | {v(b, 'tg_bytes_per_token', '{:.0f}')} | "
                f"{mem(a)} | {mem(b)} |"
            )
        pairs = {_link_label(e["cell"]): e["pair_ratios"] for e in cells if any((e.get("pair_ratios") or {}).values())}
        if pairs:

            def spread(xs):
                return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "–"

            lines += [
                "",
                "Each interleaved pair of invocations, shardwire / llama.cpp (prompt; decode): "
                + "; ".join(
                    f"{setup}: {spread(r['pp'])}; {spread(r['tg'])} ({max(len(r['pp']), len(r['tg']))} pairs)"
                    for setup, r in pairs.items()
                )
                + ".",
            ]
        kernels = {
            _link_label(e["cell"]): "; ".join(e["systems"]["shardwire"]["formats"])
            for e in cells
            if e["systems"].get("shardwire", {}).get("formats")
        }
        if kernels:
            lines += [
                "",
                "shardwire's kernels (per stage: stored type:kernel): "
                + ". ".join(f"{setup}: {text}" for setup, text in kernels.items()),
            ]
        errors = [
            (e["cell"]["key"], st.get("error") or e.get("error"))
            for e in cells
            for st in list(e["systems"].values()) + [{}]
            if (not st.get("ok") and st.get("error")) or e.get("error")
        ]
        for key, err in dict(errors).items():
            lines.append(f"\n{key}: {err}")
        eff = s["efficiency"].get(w)
        if eff:
            lines += [
                "",
                "Distributed efficiency (decode t/s with N workers on loopback / own single-process t/s, the single "
                "process rerun beside each cell where the run did so): "
                + "; ".join(
                    f"{sys_} " + ", ".join(f"N={k}: {v:.2f}" for k, v in sorted(d.items())) for sys_, d in eff.items()
                ),
            ]
        lat = s["latency"].get(w)
        if lat:
            lines += [
                "",
                "Decode time per token against link delay (from the sweep: the delay switched between the decode "
                "runs of each invocation, added time = median over each delayed run minus the 0 ms run just "
                "before it; else from the separate relay cells):",
                "",
                "| link (relay, 1 Gbit/s) | ms/token llama.cpp | shardwire | added vs 0 ms llama.cpp | "
                "shardwire | shardwire bound (crossings x delay + 10%) |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for wk, links in lat.items():
                for link, row in links.items():
                    a, b = row.get("llama.cpp", {}), row.get("shardwire", {})
                    lines.append(
                        f"| {wk[1:]} workers, {link} ms one-way | {_f(a.get('ms_per_token'), '{:.2f}')} | "
                        f"{_f(b.get('ms_per_token'), '{:.2f}')} | {_f(a.get('added_ms'), '{:.2f}')} "
                        f"({_f(a.get('equivalent_one_way_crossings'), '{:.1f}')} crossings) | "
                        f"{_f(b.get('added_ms'), '{:.2f}')} ({_f(b.get('equivalent_one_way_crossings'), '{:.1f}')}"
                        f" crossings) | {_f(b.get('bound_ms'), '{:.2f}')} |"
                    )
        wire = [
            (e["cell"], e["systems"]["shardwire"]["relay_bytes_per_token"])
            for e in cells
            if e["systems"].get("shardwire", {}).get("relay_bytes_per_token")
        ]
        wire_l = [
            (e["cell"], e["systems"]["llama.cpp"]["relay_bytes_per_token"])
            for e in cells
            if e["systems"].get("llama.cpp", {}).get("relay_bytes_per_token")
        ]
        if wire:
            cell, per = wire[0]
            lines += [
                "",
                f"Bytes per decode step through each worker's relay ({_link_label(cell)}; up = towards the "
                "worker, down = from it): shardwire "
                + ", ".join(f"{k} {v['up']:.0f} up / {v['down']:.0f} down" for k, v in per.items())
                + (
                    "; llama.cpp "
                    + ", ".join(f"{k} {v['up']:.0f} up / {v['down']:.0f} down" for k, v in wire_l[0][1].items())
                    if wire_l
                    else ""
                ),
            ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The plot


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    workloads = [w for w in results["meta"]["models"] if any(e["cell"]["workload"] == w for e in s["cells"].values())]
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 3.9 * len(workloads) + 0.6), squeeze=False)

    def get(w, k, link, system, field="tg_ts"):
        e = s["cells"].get(f"{w}/w{k}/{link}", {}).get("systems", {}).get(system, {})
        return e.get(field) if e.get("ok") else None

    for row, w in enumerate(workloads):
        systems = [x for x in SYSTEMS if any(x in e["systems"] for e in s["cells"].values())]
        # 1. decode tokens/s against workers (loopback), with the single-process baseline at 0
        for col, (field, title) in enumerate([("tg_ts", "decode tokens/s"), ("pp_ts", "prompt tokens/s")]):
            ax = axes[row][0 if col == 0 else 2]
            xs_all = [0, 1, 2, 3]
            width = 0.38
            for i, system in enumerate(systems):
                ys = [get(w, 0, "local", system, field)] + [get(w, k, "direct", system, field) for k in (1, 2, 3)]
                xs = [x + (i - (len(systems) - 1) / 2) * width for x in xs_all]
                bars = ax.bar(
                    [x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, color=COLORS[system], label=system
                )
                for bar in bars:
                    ax.annotate(
                        f"{bar.get_height():.0f}" if bar.get_height() >= 10 else f"{bar.get_height():.1f}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                    )
            if len(systems) == 2:
                for x, k, link in zip(xs_all, (0, 1, 2, 3), ("local", "direct", "direct", "direct")):
                    a, b = get(w, k, link, "llama.cpp", field), get(w, k, link, "shardwire", field)
                    if a and b:
                        top = max(a, b)
                        ax.annotate(
                            f"×{b / a:.2f}",
                            (x, top * 1.13),
                            ha="center",
                            fontsize=10,
                            fontweight="bold",
                            color=COLORS["shardwire"] if b >= a else "#b02020",
                        )
            ax.set_xticks(xs_all, ["single\nprocess", "1 worker", "2 workers", "3 workers"])
            ax.set_ylabel(title)
            ax.set_title(f"{w}: {title} on loopback (×: shardwire / llama.cpp)", fontsize=10)
            lo, hi = ax.get_ylim()
            ax.set_ylim(0, hi * 1.25)
            ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
            ax.grid(axis="y", alpha=0.3)
        # 2. decode ms/token against one-way delay (2 workers through relays), with shardwire's bound
        ax = axes[row][1]
        delays = [0.0, 0.2, 1.0]
        plotted = False
        for k in (2, 1, 3):
            for system in systems:
                sweep = get(w, k, "sweep", system, "sweep") or {}
                ys = [sweep.get(link) or get(w, k, link, system) for link in ("0", "0.2", "1")]
                pts = [(d, 1000 / y) for d, y in zip(delays, ys) if y]
                if len(pts) < 2:
                    continue
                plotted = True
                ax.plot(
                    *zip(*pts),
                    marker="o",
                    color=COLORS[system],
                    label=f"{system}, {k} workers",
                    linestyle="-" if k == 2 else ":",
                )
                for d, y in pts:
                    ax.annotate(
                        f"{y:.1f}", (d, y), textcoords="offset points", xytext=(4, 4), fontsize=8, color=COLORS[system]
                    )
                if system == "shardwire" and pts[0][0] == 0:
                    base = pts[0][1]
                    ax.plot(
                        [0, 1],
                        [base, base + (k + 1) * 1.0 * 1.1],
                        color=COLORS[system],
                        alpha=0.35,
                        linestyle="--",
                        label=f"shardwire target: +{k + 1} crossings x delay (+10%)",
                    )
            if plotted:
                break
        if not plotted:
            ax.axis("off")
            ax.text(
                0.5,
                0.5,
                "no link-delay runs for this model",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
            continue
        wire = {
            x: next(
                (
                    e["systems"][x].get("tg_bytes_per_token")
                    for e in s["cells"].values()
                    if e["cell"]["workload"] == w
                    and e["cell"]["workers"] == 2
                    and e["systems"].get(x, {}).get("tg_bytes_per_token")
                ),
                None,
            )
            for x in systems
        }
        if any(wire.values()):
            ax.text(
                0.02,
                0.97,
                "bytes on the wire per decode step (2 workers):\n"
                + "\n".join(f"{x}: {v / 1000:.1f} kB" for x, v in wire.items() if v),
                transform=ax.transAxes,
                va="top",
                fontsize=8,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.85, edgecolor="#cccccc"),
            )
        ax.set_xlabel("one-way link delay, ms (relay, 1 Gbit/s)")
        ax.set_ylabel("ms per decoded token (lower is better)")
        ax.set_title(f"{w}: decode time per token against link delay", fontsize=10)
        ax.set_xticks(delays)
        ax.grid(alpha=0.3)
        lo, hi = ax.get_ylim()
        ax.set_ylim(0, hi * 1.45)  # room for the bytes box above the lines
        ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    meta = results["meta"]
    fig.suptitle(
        f"shardwire vs llama.cpp RPC · {meta['machine'].get('cores')} cores, {meta['threads']} thread(s) per "
        f"process · {meta['mode']} run {meta['started']}",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict, out: Path) -> None:
    (out / "results.md").write_text(markdown(results))
    try:
        plot(results, out / "results.png")
    except ImportError:
        print("matplotlib is not installed (pip install 'shardwire[bench]'): no plot", file=sys.stderr)


def main() -> int:
    path = Path(sys.argv[1])
    results = json.loads(path.read_text())
    results["summary"] = summarize(results)
    path.write_text(json.dumps(results, indent=1))
    write(results, path.parent)
    print((path.parent / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
