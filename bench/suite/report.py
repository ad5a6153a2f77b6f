"""The bench suite's report, from the document `bench.suite.runner` builds (suite.json): RESULTS.md, plots.

Owns: the markdown (results table, pgmesh3-vs-pgmesh2 link table, per-system status, errors), the lag and
throughput plots (matplotlib, optional), and the metric conventions they share with the suite (which
metrics are lower-is-better or information only, each workload's primary metric, a per-link metric's base).

Must not: run, time or measure anything, or read anything but the document it is given; the suite's
numbers (summary, ratios, link checks) are computed in `bench.suite.runner` and only formatted here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from bench.harness.runs import SYSTEMS

LOWER_IS_BETTER = ("p50 ms", "p99 ms", "visible s")
INFO_ONLY = ("conflicts",)
PRIMARY = {"tpcb": "tx/s", "bulk": "rows/s", "inserts": "tx/s", "visibility": "visible s", "lag": "p50 ms",
           "multimaster": "tx/s"}


def base_metric(metric: str) -> str:
    """`tx/s a->b` -> `tx/s`."""
    return metric.split(" a->")[0]


def _fmt(value: float, metric: str) -> str:
    base = base_metric(metric)
    if base in INFO_ONLY:
        return f"{value:,.0f}"
    if base in LOWER_IS_BETTER:
        return f"{value:,.3f}" if base == "visible s" else f"{value:,.2f}"
    return f"{value:,.0f}"


def _ratio(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.3f}x"


def system_status(doc: dict[str, Any]) -> dict[str, str]:
    """One line per system: ok, not run (with the reason) or partly failed."""
    out = {}
    for system in doc["systems"]:
        done = [m for m in doc["measurements"] if m["system"] == system]
        failed = [f for f in doc["failures"] if f["system"] == system]
        if not done and failed:
            out[system] = f"not run: {failed[0]['error']}"
        elif failed:
            kinds = sorted({f"{f['workload']} (run {f['run']})" for f in failed})
            out[system] = f"ran, with failures in {', '.join(kinds)} (see Errors)"
        elif done:
            out[system] = f"ok ({len(done)} measurements)"
        else:
            out[system] = "not run: no workload selected for it"
    return out


def _window(row: dict[str, Any]) -> str:
    """A rate's window: `catch-up s (first apply s)`, medians; '' when not timed as a window."""
    seconds, first = row.get("seconds"), row.get("first_apply_s")
    if seconds is None:
        return ""
    return f"{seconds:.2f}" + (f" ({first:.2f})" if first is not None else "")


def results_table(doc: dict[str, Any]) -> list[str]:
    lines = ["| system | workload | metric | min | median | ratio to native | s (first apply s) |",
             "|---|---|---|--:|--:|--:|--:|"]
    for row in doc["summary"]:
        ratio = _ratio(row["ratio"])
        if ratio and row["workload"] == "multimaster":
            ratio += " (of pgmesh2)"
        low, mid = _fmt(row["min"], row["metric"]), _fmt(row["median"], row["metric"])
        lines.append(f"| {row['system']} | {row['workload']} | {row['metric']} | {low} | {mid} | {ratio}"
                     f" | {_window(row)} |")
    lines += [f"| {n['system']} | {n['workload']} | {PRIMARY[n['workload']]} | n/a | n/a | {n['reason']} |  |"
              for n in doc["not_run"]]
    return lines


def _measured(doc: dict[str, Any]) -> str:
    measured = doc.get("rtt_measured_ms")
    if not measured:
        return "not measured"
    return f"{measured[0]:.3f} ms direct, {measured[1]:.3f} ms through the proxy"


def render_markdown(doc: dict[str, Any], results_link: str) -> str:
    m = doc["machine"]
    lines = [
        "# pgmesh bench suite: pgmesh beside native logical replication, pglogical and Bucardo",
        "",
        f"Run with `{doc['command']}` at commit {doc.get('commit', '?')}; finished {doc['finished']}, took"
        f" {doc['wall_s'] / 60:.1f} min"
        f" ({doc['runs']} run(s) per system, fresh nodes per system and run, system order alternating).",
        "The machine is shared and noisy: compare ratios from one run of the suite, not absolute figures"
        " across files.",
        "",
        "## Machine",
        "",
        f"- {m['cpus']} CPUs ({m['cpu_model']}), {m['memory']} RAM, {m['platform']}",
        f"- {m['postgres']}; pglogical {m['pglogical']}; Bucardo {m['bucardo']}",
        f"- Python {m['python']}, {m['loop']}",
        "",
        "## Server settings (every node of every system)",
        "",
        "Set by `router.testing.localnodes` (all nodes local on 127.0.0.1, one cluster per node)"
        " plus the suite's:",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in doc["server_settings"].items()],
        "",
        f"## Workloads (scale {doc['sizes']['scale']:g}, {doc['sizes'].get('backlog', 'default')} backlogs)",
        "",
        *[f"- {line}" for line in doc["workload_sizes"]],
        "",
        "Backlogs are made on a while replication is stopped and timed from start until every target shows a",
        "marker committed after them. pgmesh3 writes on a and reports each link (a->b, a->c) and both"
        " together (the row without a link). Before each workload every node gets a VACUUM ANALYZE and a"
        " CHECKPOINT; pgmesh"
        " also runs its router until every slot is confirmed to the nodes' WAL position (the echoes of"
        " the last workload decoded), Bucardo purges and vacuums its delta tables.",
        "",
        *([f"Every system's replication connections had {doc['rtt_ms']:g} ms added to their round trip"
           " (a delaying proxy on loopback, bench.harness.delay): a subscriber's to its publisher, pgmesh's"
           " router's to every node. The workloads' clients connected directly. Round trip of `SELECT 1`"
           f" measured before the runs: {_measured(doc)}.", ""]
          if doc.get("rtt_ms") else []),
        "## Results",
        "",
        *results_table(doc),
        "",
        "Ratio: of the medians; system/native for throughput and native/system for lag and visibility"
        " seconds, so higher is always better and 1.00x = as good as native. Multimaster has no native"
        " anchor: its ratio is system/pgmesh2. `conflicts` is the count the system reports for the"
        " workload (pgmesh: decided on every link; Bucardo: its \"Conflicts for\" log lines), not timed.",
        "`s (first apply s)`: median seconds the rate's window lasted (a backlog: from the start command"
        " until every target had the marker, per link until that target had it; multimaster: until the"
        " nodes converged) and, in brackets, until a target's origin first moved (the apply worker's or the"
        " router's start; for bulk the one big transaction's decoding and apply). A start that is a large"
        " part of the window weighs on the rate: compare with `--backlog long`.",
        "",
    ]
    if doc["links"]:
        lines += ["## 3 nodes vs 2 nodes, per link (pgmesh's target: each link within 20% of the 2-node rate;"
                  " native3 is PostgreSQL's own apply to two subscribers, the control)", "",
                  "| system | workload | metric | 2-node median | 3-node median | 3 / 2 | within 20% |",
                  "|---|---|---|---:|---:|---:|---|"]
        for r in doc["links"]:
            lines.append(f"| {r['system']} / {r['two_nodes']} | {r['workload']} | {r['metric']}"
                         f" | {_fmt(r['two_nodes_median'], r['metric'])} | {_fmt(r['median'], r['metric'])}"
                         f" | {_ratio(r['vs_two_nodes'])} | {'yes' if r['within_20pct'] else 'no'} |")
        lines.append("")
    lines += ["## Systems", ""]
    lines += [f"- {system}: {text}" for system, text in system_status(doc).items()]
    lines += ["", "## Errors", ""]
    if doc["failures"]:
        lines += ["| system | workload | run | error |", "|---|---|---|---|"]
        for f in doc["failures"]:
            error = f["error"].replace("|", "/").replace("\n", " ")
            lines.append(f"| {f['system']} | {f['workload']} | {f['run']} | {error} |")
    else:
        lines.append("None.")
    lines += [
        "",
        "## Plots",
        "",
        f"![lag over time]({results_link}/lag.png)",
        "",
        f"![throughput ratio to native]({results_link}/throughput.png)",
        "",
        f"Raw numbers (every run, CPU seconds per node, lag series): `{results_link}/suite.json`.",
        "",
        "## Notes",
        "",
        *[f"- {system}: " + " ".join((SYSTEMS[system].__doc__ or "").split("\n\n")[0].split())
          for system in doc["systems"]],
        "",
    ]
    return "\n".join(lines)


def write_plots(doc: dict[str, Any], outdir: Path) -> list[str]:
    """lag.png and throughput.png; returns what went wrong (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["matplotlib is not installed (pip install -e '.[bench]'): no plots"]
    problems = []
    fig, ax = plt.subplots(figsize=(10, 5))
    plotted = False
    for system in doc["systems"]:
        lag = [m for m in doc["measurements"] if m["system"] == system and m["workload"] == "lag"]
        if not lag:
            continue
        first = min(lag, key=lambda m: m["run"])["details"]
        for i, target in enumerate(first["targets"]):
            label = system if len(first["targets"]) == 1 else f"{system} a->{target}"
            ax.plot([p[0] for p in first["series"]], [p[1][i] for p in first["series"]], label=label,
                    linewidth=0.8, marker=".", markersize=3)
            plotted = True
    if plotted:
        ax.set_yscale("log")
        ax.set_xlabel("seconds into the steady load")
        ax.set_ylabel("probe lag, ms (log scale)")
        load = next((line.removeprefix("lag: ").split(",")[0] for line in doc["workload_sizes"]
                     if line.startswith("lag: ")), "a steady load")
        ax.set_title(f"Lag under {load} (first run of each system)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.savefig(outdir / "lag.png", dpi=110, bbox_inches="tight")
    else:
        problems.append("no lag measurements: lag.png not written")
    plt.close(fig)
    _throughput_plot(plt, doc, outdir)
    return problems


def _throughput_plot(plt: Any, doc: dict[str, Any], outdir: Path) -> None:
    metrics = [("tpcb", "tx/s"), ("bulk", "rows/s"), ("inserts", "tx/s"), ("visibility", "visible s"),
               ("lag", "p50 ms"), ("lag", "p99 ms")]
    ratios = {(r["system"], r["workload"], r["metric"]): r["ratio"] for r in doc["summary"]}
    medians = {(r["system"], r["workload"], r["metric"]): r["median"] for r in doc["summary"]}
    systems = [s for s in doc["systems"] if s != "native"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs, ys = [], []
        for j, (workload, metric) in enumerate(metrics):
            ratio = ratios.get((system, workload, metric))
            if ratio is not None:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(ratio)
        left.bar(xs, ys, width, label=system)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="native = 1")
    left.set_xticks(range(len(metrics)), [f"{w}\n{m}" for w, m in metrics])
    left.set_ylabel("ratio to native (median; higher is better)")
    left.set_title("Throughput (and inverse lag / visibility time) relative to native")
    left.legend(fontsize=8)
    left.grid(True, axis="y", alpha=0.3)
    mm = [(s, medians[key]) for s in doc["systems"] if (key := (s, "multimaster", "tx/s")) in medians]
    right.bar([s for s, _ in mm], [v for _, v in mm], color="tab:gray")
    right.set_ylabel("tx/s over all nodes until converged (median)")
    right.set_title("multimaster")
    right.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(outdir / "throughput.png", dpi=110)
    plt.close(fig)


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout

    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    dirty = ", ".join(sorted({line[3:].split("/")[0] for line in changed if "bench/results/" not in line}))
    commit = git("rev-parse", "--short", "HEAD").strip()
    return commit + (f" (uncommitted changes in {dirty})" if dirty else "")
