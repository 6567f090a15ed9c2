#!/usr/bin/env python3
"""Renders dray's Grafana dashboard to a PNG from a live Prometheus, without
Grafana: every panel of deploy/grafana/dray-dashboard.json in its grid
position, each target's PromQL asked of Prometheus's HTTP API over the
window, with Grafana's variables replaced as Grafana would
(`$__rate_interval` 4 steps, `$__range` the window, `$instance` all).
Stat panels show their last value, time series their lines, in the panel's
unit. For the operator guide's picture (tests/prometheus.rs calls it when
DRAY_DASHBOARD_PICTURE names the output file) and for anyone who wants the
dashboard's view of a Prometheus without running Grafana.

Needs matplotlib (Debian: python3-matplotlib).

    scripts/dashboard-picture.py --prometheus http://127.0.0.1:9090 \\
        --start 1733400000 --end 1733400300 --out dashboard.png
"""

import argparse
import json
import re
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/grafana/dray-dashboard.json"
BG, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a"]
# Grid units in inches: Grafana's 24 columns and 30 px rows.
COL_IN, ROW_IN = 0.75, 0.42


def query_range(prometheus, expr, start, end, step):
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"{expr}: {body}")
    return body["data"]["result"]


def substitute(expr, start, end, step):
    return (
        expr.replace("$__rate_interval", f"{4 * step}s")
        .replace("$__range", f"{max(1, round(end - start))}s")
        .replace("$__interval", f"{step}s")
        .replace("$instance", ".*")
    )


def legend(fmt, metric, expr):
    if not fmt:
        return metric.get("__name__") or expr[:40]
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def human(value, unit):
    """A value as Grafana shows it in `unit`."""
    if value != value:  # NaN
        return "NaN"
    if unit == "percentunit":
        return f"{100 * value:.1f}%"
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for name in ["B", "KiB", "MiB", "GiB", "TiB"]:
            if abs(value) < 1024 or name == "TiB":
                return f"{value:.3g} {name}{suffix}"
            value /= 1024
    if unit == "s":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit in ("ops", "reqps"):
        return f"{value:.3g} {'ops' if unit == 'ops' else 'req'}/s"
    return f"{value:.4g}"


def panels(dashboard):
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def render(prometheus, start, end, step, out):
    dashboard = json.loads(DASHBOARD.read_text())
    all_panels = list(panels(dashboard))
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in all_panels)
    fig = plt.figure(figsize=(24 * COL_IN, bottom * ROW_IN + 0.6), facecolor=BG)
    height = bottom * ROW_IN + 0.6
    span = f"{datetime.fromtimestamp(start, timezone.utc):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(end, timezone.utc):%H:%M:%S} UTC"
    fig.text(0.005, 1 - 0.3 / height, f"{dashboard.get('title', 'dray')}   ({span})", color=TEXT,
             fontsize=13, va="center", weight="bold")
    empty = 0
    for p in all_panels:
        g = p["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        top = (0.6 + g["y"] * ROW_IN) / height
        h = g["h"] * ROW_IN / height
        if p["type"] == "row":
            fig.text(left + 0.004, 1 - top - h / 2, p["title"], color=TEXT, fontsize=12,
                     va="center", weight="bold")
            continue
        pad_x, pad_y = 0.003, 0.004
        # Room inside the panel for the value axis' labels.
        label = 0.032 if p["type"] == "timeseries" else 0.0
        ax = fig.add_axes([left + pad_x + label, 1 - top - h + pad_y + 0.003,
                           width - 2 * pad_x - label, h - 2 * pad_y - 0.015], facecolor=PANEL)
        fig.text(left + pad_x + 0.004, 1 - top - 0.006, p["title"], color=TEXT, fontsize=9.5, va="top")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        series = []
        for t in p.get("targets", []):
            expr = substitute(t["expr"], start, end, step)
            for r in query_range(prometheus, expr, start, end, step):
                pts = [(float(ts), float(v)) for ts, v in r["values"]]
                series.append((legend(t.get("legendFormat"), r["metric"], expr), pts))
        for spine in ax.spines.values():
            spine.set_color(GRID)
        if not series:
            empty += 1
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center", transform=ax.transAxes)
            continue
        if p["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            values = "   ".join(human(s[1][-1][1], unit) for s in series)
            ax.text(0.5, 0.45, values, color=COLORS[0], fontsize=20, weight="bold", ha="center",
                    va="center", transform=ax.transAxes)
            continue
        for i, (name, pts) in enumerate(series[:12]):
            xs = [ts - start for ts, _ in pts]
            ax.plot(xs, [v for _, v in pts], color=COLORS[i % len(COLORS)], lw=1.4, label=name)
        ax.set_xlim(0, end - start)
        ax.grid(color=GRID, lw=0.6)
        ax.tick_params(colors=TEXT, labelsize=7)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, u=unit: human(v, u)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.0f} s"))
        ax.legend(loc="upper left", fontsize=6.5, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT,
                  ncol=2 if len(series) > 4 else 1)
    fig.savefig(out, dpi=80, facecolor=BG)
    print(f"{out}: {len(all_panels)} panels, {empty} without data")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--start", type=float, required=True, help="unix seconds")
    ap.add_argument("--end", type=float, required=True, help="unix seconds")
    ap.add_argument("--step", type=int, default=1, help="seconds between points")
    ap.add_argument("--out", required=True, help="the PNG to write")
    a = ap.parse_args()
    render(a.prometheus.rstrip("/"), a.start, a.end, a.step, a.out)


if __name__ == "__main__":
    main()
