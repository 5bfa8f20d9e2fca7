"""Figures (matplotlib, imported only when a figure is asked for)."""

from __future__ import annotations

from pathlib import Path

from kvwall.errors import KvwallError
from kvwall.files import replacing


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvwallError("plots need matplotlib: pip install 'kvwall[plot]'") from None
    return plt


def _save(fig, path: str | Path) -> Path:
    """Write the figure atomically (unique temporary, then rename); the format follows the name."""
    path = Path(path)
    try:
        with replacing(path) as f:
            fig.savefig(f, dpi=120, bbox_inches="tight", format=path.suffix.lstrip(".").lower() or "png")
    finally:
        _plt().close(fig)
    return path


def roofline(points: list[dict], peak: float, bandwidth: float, title: str, path: str | Path) -> Path:
    """Ops as points (intensity, achieved FLOP/s) under the roof min(peak, intensity x bandwidth).

    points: [{"label", "intensity", "flops_per_s", "phase"}]."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [p["intensity"] for p in points if p["intensity"] > 0] or [1.0]
    lo, hi = min(min(xs) / 4, 0.1), max(max(xs) * 4, 4 * peak / bandwidth)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * bandwidth) for x in grid], color="black", lw=2, label="roof")
    ax.axvline(peak / bandwidth, color="gray", ls=":", lw=1)
    ax.text(peak / bandwidth, peak * 0.5, f"balance {peak / bandwidth:.0f} FLOP/B", ha="right", fontsize=8)
    markers = {"prefill": "s", "decode": "o"}
    for phase in sorted({p["phase"] for p in points}):
        sel = [p for p in points if p["phase"] == phase and p["intensity"] > 0]
        ax.scatter([p["intensity"] for p in sel], [p["flops_per_s"] for p in sel], marker=markers.get(phase, "^"),
                   s=40, label=phase, alpha=0.8)
        for (x, y), names in _merge_close(sel).items():
            ax.annotate(", ".join(names), (x, y), fontsize=7, xytext=(5, -10 if phase == "decode" else 6),
                        textcoords="offset points", rotation=0 if phase == "decode" else 40)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=peak * 8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    return _save(fig, path)


def _merge_close(points: list[dict]) -> dict:
    """Points that sit on top of each other (within ~10 % in x and y) share one label."""
    import math

    merged: dict[tuple[float, float], list[str]] = {}
    for p in points:
        x, y = p["intensity"], p["flops_per_s"]
        key = next((k for k in merged if abs(math.log(k[0] / x)) < 0.25 and abs(math.log(k[1] / y)) < 0.25), (x, y))
        merged.setdefault(key, []).append(p["label"])
    return merged


def lines(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str, path: str | Path,
          logx: bool = True, logy: bool = False, hline: tuple[float, str] | None = None,
          dashed: set[str] | None = None, marks: dict[str, list[tuple[float, float, str]]] | None = None) -> Path:
    """One line per series: {label: [(x, y), ...]}; marks: {label: [(x, y, text), ...]} ringed and labelled on
    that series' line (e.g. where a model moves to a larger GPU group and its time steps down)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9 if dashed else 8, 5))
    dashed = dashed or set()
    bases = list(dict.fromkeys(_base(label, dashed) for label in series))
    palette = plt.get_cmap("tab10" if len(bases) <= 10 else "tab20")
    for label, pts in series.items():
        pts = [(x, y) for x, y in pts if y is not None]
        if not pts:
            continue
        color = palette(bases.index(_base(label, dashed)) % palette.N)  # a series and its dashed twin share a colour
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, color=color,
                ls="--" if label in dashed else "-", label=None if label in dashed else label)
        for x, y, text in (marks or {}).get(label, []):
            ax.plot([x], [y], marker="o", ms=9, mfc="none", color=color)
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7, color=color)
    if hline:
        ax.axhline(hline[0], color="red", ls=":", lw=1)
        ax.text(ax.get_xlim()[0], hline[0], " " + hline[1], color="red", va="bottom", fontsize=8)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if dashed:
        ax.plot([], [], color="gray", ls="--", label="(dashed: predicted)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.2)
    return _save(fig, path)


def _base(label: str, dashed: set) -> str:
    """The series a dashed twin belongs to: 'gqa (predicted)' -> 'gqa'."""
    return label.rsplit(" (", 1)[0] if label in dashed else label


def bars(labels: list[str], values: list[float], ylabel: str, title: str, path: str | Path,
         logy: bool = False) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(labels, values, color="#4a7ab5")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)


def grouped_bars(labels: list[str], groups: dict[str, list[float]], ylabel: str, title: str,
                 path: str | Path) -> Path:
    """Side-by-side bars per label, one colour per group."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(groups)
    for g, (name, values) in enumerate(groups.items()):
        xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width, label=name)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.1f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def versus(points: list[dict], xlabel: str, ylabel: str, title: str, path: str | Path) -> Path:
    """Predicted against measured, log-log, one marker per group, with the y = x line.

    points: [{"group", "measured", "predicted"}], both positive and in the same unit per point; an optional
    "mode" of "ideal" draws the point hollow (the same group's marker and colour)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 6))
    markers = "osD^vP*X<>"
    groups = list(dict.fromkeys(p["group"] for p in points))
    for i, g in enumerate(groups):
        color = f"C{i % 10}"
        for hollow in (False, True):
            sel = [p for p in points if p["group"] == g and (p.get("mode") == "ideal") == hollow]
            if not sel:
                continue
            label = f"{g} ({len(sel)})" + (", ideal" if hollow else "")
            ax.scatter([p["measured"] for p in sel], [p["predicted"] for p in sel], marker=markers[i % len(markers)],
                       s=36, alpha=0.8, label=label, edgecolors=color, facecolors="none" if hollow else color)
    values = [v for p in points for v in (p["measured"], p["predicted"])] or [1.0]
    lo, hi = min(values) / 2, max(values) * 2
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.2)
    return _save(fig, path)


def two_axes(x: list[float], left: tuple[str, list[float]], right: tuple[str, list[float]], xlabel: str, title: str,
             path: str | Path) -> Path:
    """Two quantities of different units against one x: `left` on the left axis (solid), `right` on the right
    (dashed); each is (label, values)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(x, left[1], marker="o", color="tab:blue")
    ax.set_ylabel(left[0], color="tab:blue")
    twin = ax.twinx()
    twin.plot(x, right[1], marker="s", ls="--", color="tab:red")
    twin.set_ylabel(right[0], color="tab:red")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def serving(latencies: dict[str, list[float]], trace: list[dict], blocks: int, title: str, path: str | Path) -> Path:
    """A served stream: latency CDFs (ms, log x) on the left; KV blocks in use and requests running and
    waiting over time on the right. latencies: {"TTFT": [s, ...], "TPOT": [...]}; trace: simulate.report's."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in latencies.items():
        xs = sorted(v * 1e3 for v in values if v is not None and v > 0)
        if xs:
            left.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} ({len(xs)})")
    left.set_xscale("log")
    left.set_xlabel("ms")
    left.set_ylabel("fraction of requests at or below")
    left.grid(True, which="both", alpha=0.2)
    left.legend(fontsize=8)
    times = [row["time_s"] for row in trace]
    right.plot(times, [row["blocks_used"] / blocks for row in trace], color="#4a7ab5", label="KV blocks in use")
    right.set_ylim(0, 1.05)
    right.set_xlabel("simulated time (s)")
    right.set_ylabel("fraction of the KV pool")
    twin = right.twinx()
    twin.plot(times, [row["running"] for row in trace], color="#3a9a4a", lw=1, label="running")
    twin.plot(times, [row["waiting"] for row in trace], color="#c0504d", lw=1, label="waiting")
    twin.set_ylabel("requests")
    right.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def pareto(points: list[dict], xlabel: str, ylabel: str, title: str, path: str | Path) -> Path:
    """One labelled point per configuration [{"label", "x", "y"}], the Pareto front (lowest x, highest y) joined."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    pts = [p for p in points if p["x"] is not None and p["y"] is not None]
    ax.scatter([p["x"] for p in pts], [p["y"] for p in pts], color="#4a7ab5")
    for p in pts:
        ax.annotate(p["label"], (p["x"], p["y"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front, best = [], -1.0
    for p in sorted(pts, key=lambda p: (p["x"], -p["y"])):
        if p["y"] > best:
            front.append(p)
            best = p["y"]
    ax.plot([p["x"] for p in front], [p["y"] for p in front], color="#c0504d", lw=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=8)
    return _save(fig, path)


def quality(data: dict, path: str | Path) -> Path:
    """kvwall quality's figure: Δ perplexity against cache bytes per token (one labelled point per strategy) and,
    when pass-key ran, a heat-map of its accuracy (length x depth) per strategy.

    data: measure.quality.measure's result."""
    plt = _plt()
    pk = data.get("passkey")
    names = list(dict.fromkeys(c["cache"] for c in pk["cells"])) if pk else []
    banded = len(data["quality"][0].get("bands", [])) > 1  # long rows: Δ% by context beside the bytes panel
    cols = max(1, min(4, len(names)), 2 if banded else 1)
    heat_rows = -(-len(names) // cols)
    fig = plt.figure(figsize=(3.2 * max(cols, 2) * (1.4 if banded else 1), 4.5 + 2.6 * heat_rows))
    grid = fig.add_gridspec(1 + heat_rows, cols, height_ratios=[1.7] + [1] * heat_rows)
    if banded:
        half = cols // 2
        _quality_points(fig.add_subplot(grid[0, :half]), data)
        _quality_by_context(fig.add_subplot(grid[0, half:]), data)
    else:
        _quality_points(fig.add_subplot(grid[0, :]), data)
    for i, name in enumerate(names):
        _passkey_map(fig.add_subplot(grid[1 + i // cols, i % cols]), pk, name, plt)
    fig.tight_layout()
    return _save(fig, path)


def _quality_points(ax, data: dict) -> None:
    rows = data["quality"]
    ax.scatter([r["bytes_per_token"] for r in rows], [r["delta_ppl"] for r in rows], color="#4a7ab5", s=36)
    same: dict[tuple[float, float], list[str]] = {}  # strategies on the same spot share one label
    for r in rows:
        same.setdefault((r["bytes_per_token"], round(r["delta_ppl"], 4)), []).append(r["cache"])
    for (x, y), names in same.items():
        ax.annotate(", ".join(names), (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.axhline(0, color="gray", lw=1, ls=":")
    ax.set_xlabel("cache bytes per token (the cache's own count)")
    ax.set_ylabel("Δ perplexity vs the exact cache")
    t = data["text"]
    ax.set_title(f"{data['model']}: what each saving costs ({t['used']:,} tokens, rows of {t['row_tokens']})",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.2)


def _quality_by_context(ax, data: dict) -> None:
    """Δ perplexity (% of the exact cache's, same band) against context, one line per saving: each band drawn at
    its end (the cost on tokens with up to that many before them), on a symmetric-log y axis."""
    from kvwall.measure.quality import band_label

    rows = data["quality"]
    ends = [b["end"] for b in rows[0]["bands"]]
    for r in rows[1:]:
        ys = [b["delta_pct"] for b in r["bands"]]
        ax.plot(ends, ys, "o-", lw=1.2, ms=4, label=r["cache"])
        ax.annotate(f"{ys[-1]:+.1f}%", (ends[-1], ys[-1]), fontsize=7, xytext=(4, 0), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ends, [band_label(b) for b in rows[0]["bands"]], fontsize=8)
    ax.minorticks_off()
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=min([-0.5] + [b["delta_pct"] * 1.3 for r in rows for b in r["bands"]]))  # no empty negative side
    ax.axhline(0, color="gray", lw=1, ls=":")
    ax.set_xlabel("context of the scored tokens (band)")
    ax.set_ylabel("Δ perplexity vs exact (%)")
    ax.set_title(f"cost by context ({data['text']['rows']} row(s) of {data['text']['row_tokens']:,})", fontsize=10)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="upper left")


def _passkey_map(ax, pk: dict, name: str, plt) -> None:
    """Accuracy per (depth, length) for one strategy, 0 to 1, each cell labelled."""
    cells = {(c["length"], c["depth"]): c["accuracy"] for c in pk["cells"] if c["cache"] == name}
    grid = [[cells[(n, d)] for n in pk["lengths"]] for d in pk["depths"]]
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v * 100:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(pk["lengths"])), [str(n) for n in pk["lengths"]], fontsize=7)
    ax.set_yticks(range(len(pk["depths"])), [f"{d * 100:.0f}%" for d in pk["depths"]], fontsize=7)
    ax.set_xlabel("context (tokens)", fontsize=8)
    ax.set_ylabel("key depth", fontsize=8)
    ax.set_title(f"{name}: pass key %", fontsize=9)


def recall(data: dict, path: str | Path) -> Path:
    """kvwall recall's figure: held-out MQAR accuracy against the bytes a model keeps per sequence (log x), one
    line per architecture through its widths, one panel per number of pairs; chance as a dotted line.

    data: measure.recall.run's result."""
    plt = _plt()
    rows = data["results"]
    pairs = sorted({r["pairs"] for r in rows})
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    fig, axes = plt.subplots(1, len(pairs), figsize=(3.6 * len(pairs) + 1.2, 3.8), sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, n in zip(axes[0], pairs):
        for i, arch in enumerate(archs):
            pts = sorted((r["kept_bytes"], r["accuracy"] * 100, r["width"]) for r in rows
                         if r["arch"] == arch and r["pairs"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[i % len(colors)], label=arch)
            for x, y, w in pts:
                ax.annotate(str(w), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(data["task"]["chance"] * 100, color="gray", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_title(f"{n} key-value pair{'s' if n != 1 else ''}", fontsize=10)
        ax.set_xlabel("kept bytes per sequence")
        ax.grid(True, which="both", alpha=0.2)
    axes[0][0].set_ylabel("recall accuracy (%)")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"MQAR at {data['task']['seq']} tokens: recall against memory (points labelled by width)",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
