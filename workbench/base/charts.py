"""The figures of runs and estimates, shared by the web UI and the Python API.

Drawn with matplotlib's object API (no pyplot global state, safe across threads). They only draw
numbers computed elsewhere: the estimator's breakdown, metrics.jsonl rows, run summaries. Each takes an
optional `ax` so several can share one figure (`workbench.plot_compare`).
"""

from __future__ import annotations

import math
import numbers

from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from workbench.base.metric_names import REWARD_METRIC


class WorkbenchFigure(Figure):
    """A Figure that shows itself in Jupyter without pyplot (which these charts never touch)."""

    def _repr_png_(self) -> bytes:
        import io

        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()


GIB = 2**30
PARTS = ["weights", "adapter", "gradients", "optimizer", "activations", "other"]
PART_COLORS = ["#4f46e5", "#a855f7", "#f59e0b", "#ef4444", "#10b981", "#94a3b8"]
SERIES_COLORS = ["#4f46e5", "#f97316", "#10b981", "#e11d48", "#0ea5e9", "#a855f7", "#84cc16", "#64748b"]
INK, MUTED = "#1e293b", "#64748b"


def _figure(width: float = 7.0, height: float = 3.6, ax=None):
    """(figure, styled axes): new ones, or the given axes of a larger figure."""
    if ax is None:
        fig = WorkbenchFigure(figsize=(width, height), dpi=110, layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color("#cbd5e1")
    ax.tick_params(colors=MUTED, labelsize=9)
    ax.grid(axis="y", color="#e2e8f0", linewidth=0.8)
    ax.set_axisbelow(True)
    return fig, ax


def _title(ax, text: str) -> None:
    ax.set_title(text, loc="left", fontsize=11, color=INK, fontweight="bold", pad=10)


def empty(message: str, width: float = 7.0, height: float = 3.2, ax=None) -> Figure:
    fig, ax = _figure(width, height, ax)
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", color=MUTED, fontsize=11, transform=ax.transAxes)
    return fig


def memory_breakdown(strategies: list[dict], recommended: str | None, device_bytes: float | None,
                     device_label: str = "device", ax=None) -> Figure:
    """Stacked per-device memory (GiB) of each strategy, with the device's memory as a dashed line."""
    if not strategies:
        return empty("no strategies in the estimate", ax=ax)
    fig, ax = _figure(7.6, 4.0, ax)
    names = [s["name"] for s in strategies]
    xs = list(range(len(names)))
    bottoms = [0.0] * len(names)
    for part, color in zip(PARTS, PART_COLORS):
        heights = [float((s.get("breakdown") or {}).get(part) or 0) / GIB for s in strategies]
        if any(heights):
            ax.bar(xs, heights, bottom=bottoms, color=color, label=part, width=0.62, edgecolor="white", linewidth=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    totals = [max(float(s.get("per_device_bytes") or 0) / GIB, b) for s, b in zip(strategies, bottoms)]
    top = max(totals) or 1.0
    for x, total, s in zip(xs, totals, strategies):
        fits = s.get("fits")
        ax.text(x, total + top * 0.02, f"{_gib(total)}\n{'fits' if fits else 'too big'}", ha="center",
                va="bottom", fontsize=7.5, color=INK if fits else "#b91c1c")
    capacity = (device_bytes or 0) / GIB
    line = f"{device_label}: {_gib(capacity)}"
    if capacity and capacity <= top * 3:  # on the scale: draw it
        top = max(top, capacity)
        ax.axhline(capacity, color="#b91c1c", linestyle="--", linewidth=1.4)
        ax.text(xs[-1] + 0.45, capacity, line, color="#b91c1c", fontsize=8, va="bottom", ha="right")
    elif capacity:  # far above every bar: say so instead of squashing the bars flat
        ax.text(0.99, 0.98, f"▲ {line} (far above the bars)", transform=ax.transAxes, color="#b91c1c",
                fontsize=8, va="top", ha="right")
    ax.set_xticks(xs, [("★ " if n == recommended else "") + n.replace("_", "\n") for n in names])
    for label, name in zip(ax.get_xticklabels(), names):
        if name == recommended:
            label.set_fontweight("bold")
            label.set_color("#4338ca")
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("memory per device (GiB)", color=MUTED, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    _title(ax, "Memory per device, by strategy (★ recommended)")
    return fig


def _gib(value: float) -> str:
    return f"{value:,.0f} GiB" if value >= 10 else f"{value:.2g} GiB" if value >= 0.01 else f"{value * 1024:.0f} MiB"


def _number(value) -> float | None:
    """A finite real number as a float; None for anything else (a missing key, NaN from a DataFrame, text)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _records(rows) -> list[dict]:
    """metrics.jsonl rows as dicts, from a list of rows or a pandas DataFrame (`Run.history`)."""
    if rows is None:
        return []
    if hasattr(rows, "to_dict"):
        rows = rows.to_dict("records")
    return [r for r in rows if isinstance(r, dict)]


def _points(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of the rows holding a finite number under `key` (train and eval rows share a step)."""
    found = []
    for row in _records(rows):
        step, value = _number(row.get("step")), _number(row.get(key))
        if step is not None and value is not None:
            found.append((step, value))
    return found


def curves(series: dict[str, list[dict]], key: str, title: str, ylabel: str, eval_key: str | None = None,
           ax=None) -> Figure:
    """One line per run of `key` against the step (and dashed `eval_key` points when given)."""
    drawn = False
    fig, ax = _figure(ax=ax)
    for (name, rows), color in zip(series.items(), SERIES_COLORS * 4):
        points = _points(rows, key)
        if points:
            ax.plot(*zip(*points), color=color, linewidth=1.8, label=name if len(series) > 1 or eval_key else None)
            drawn = True
        if eval_key:
            evals = _points(rows, eval_key)
            if evals:
                ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", markersize=4, linewidth=1.2,
                        label=f"{name} (eval)")
                drawn = True
    if not drawn:
        return empty(f"{title}: no metrics yet", ax=ax)
    ax.set_xlabel("optimizer step", color=MUTED, fontsize=9)
    ax.set_ylabel(ylabel, color=MUTED, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(frameon=False, fontsize=8)
    _title(ax, title)
    return fig


def run_bars(rows: list[dict], bars: list[tuple[str, str]], title: str, ylabel: str, scale: float = 1.0,
             ax=None) -> Figure:
    """Grouped bars per run: `bars` are (column, legend label) pairs from the compare rows."""
    rows = [r for r in rows if any(r.get(col) is not None for col, _ in bars)]
    if not rows:
        return empty(f"{title}: choose runs with figures", ax=ax)
    fig, ax = _figure(ax=ax)
    width = 0.8 / len(bars)
    for i, ((col, label), color) in enumerate(zip(bars, SERIES_COLORS)):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(rows))]
        values = [(r.get(col) or 0) * scale for r in rows]
        ax.bar(xs, values, width=width * 0.92, color=color, label=label)
        for x, v, r in zip(xs, values, rows):
            ax.text(x, v, "n/a" if r.get(col) is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}",
                    ha="center", va="bottom", fontsize=8, color=INK)
    ax.set_xticks(range(len(rows)), [r["run"] for r in rows], rotation=15 if len(rows) > 4 else 0)
    ax.set_ylabel(ylabel, color=MUTED, fontsize=9)
    ax.set_ylim(0, (ax.get_ylim()[1] or 1) * 1.12)
    if len(bars) > 1:
        ax.legend(frameon=False, fontsize=8)
    _title(ax, title)
    return fig


# -- preference runs (training.objective dpo / orpo) ------------------------------------------------

# what a preference run logs beside its loss (metrics.jsonl; evaluation rows prefix them with eval_)
PREFERENCE_KEYS = ("reward_margin", "reward_accuracy", "rewards_chosen", "rewards_rejected", "logps_chosen",
                   "logps_rejected")
MARGIN_COLOR, ACCURACY_COLOR = "#4f46e5", "#f97316"


def is_preference(rows) -> bool:
    """Whether metrics rows (a list or a DataFrame) hold a preference run's figures, train or eval."""
    keys = [*PREFERENCE_KEYS, *(f"eval_{k}" for k in PREFERENCE_KEYS)]
    return any(_number(row.get(k)) is not None for row in _records(rows) for k in keys)


def preference_chart(frame, title: str = "Reward margin and accuracy", ax=None) -> Figure:
    """A preference run's reward margin (left axis) and reward accuracy (right axis, percent) over the steps:
    training rows as lines, evaluation rows as dashed lines with markers. `frame`: metrics.jsonl rows, as a
    list of dicts or a DataFrame (`Run.history`). An empty state when the rows hold no preference figures
    (an SFT run, or a preference run before its first logged step)."""
    rows = _records(frame)
    fig, ax = _figure(ax=ax)
    series = {key: _points(rows, key) for key in ("reward_margin", "eval_reward_margin", "reward_accuracy",
                                                  "eval_reward_accuracy")}
    if not any(series.values()):
        return empty(f"{title}: no preference metrics yet", ax=ax)
    accuracy_ax = _second_axis(ax)
    train = dict(linewidth=1.8)
    held_out = dict(linestyle="--", marker="o", markersize=4, linewidth=1.2)
    for target, key, color, label in ((ax, "reward_margin", MARGIN_COLOR, "margin"),
                                      (accuracy_ax, "reward_accuracy", ACCURACY_COLOR, "accuracy")):
        if series[key]:
            target.plot(*zip(*series[key]), color=color, label=label, **train)
        if series[f"eval_{key}"]:
            target.plot(*zip(*series[f"eval_{key}"]), color=color, label=f"{label} (eval)", **held_out)
    ax.axhline(0, color="#cbd5e1", linewidth=0.8, zorder=0)  # above it, the chosen answer is preferred
    accuracy_ax.set_ylim(-0.03, 1.03)
    accuracy_ax.yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
    _label_both(ax, accuracy_ax, "reward margin (chosen − rejected)", "reward accuracy")
    _title(ax, title)
    return fig


def _second_axis(ax):
    """A right-hand axis over `ax`, in the charts' muted style."""
    other = ax.twinx()
    other.spines["top"].set_visible(False)
    other.spines["right"].set_color("#cbd5e1")
    other.tick_params(colors=MUTED, labelsize=9)
    return other


def _label_both(ax, other, left: str, right: str) -> None:
    """The step axis, each y axis in its series' color, and one legend for the lines of both."""
    ax.set_xlabel("optimizer step", color=MUTED, fontsize=9)
    ax.set_ylabel(left, color=MARGIN_COLOR, fontsize=9)
    other.set_ylabel(right, color=ACCURACY_COLOR, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = other.get_legend_handles_labels()
    other.legend(handles + more_handles, labels + more_labels, frameon=False, fontsize=8, loc="lower right", ncols=2)


def is_rewarded(rows) -> bool:
    """Whether metrics rows hold the rewards of sampled answers (a GRPO run's `reward`), not a preference run's."""
    return any(_number(row.get(REWARD_METRIC)) is not None for row in _records(rows))


def reward_chart(frame, title: str = "Reward and answer length", ax=None) -> Figure:
    """A GRPO run's reward over the steps (left axis: the weighted sum, bold, and each reward function's mean,
    thin) and its answers' mean length (right axis, tokens). An empty state before the first logged step."""
    rows = _records(frame)
    fig, ax = _figure(ax=ax)
    total, length = _points(rows, REWARD_METRIC), _points(rows, "completions/mean_length")
    if not total:
        return empty(f"{title}: no rewards yet", ax=ax)
    ax.plot(*zip(*total), color=MARGIN_COLOR, linewidth=1.8, label="reward")
    names = sorted({k for row in rows for k in row if k.startswith("rewards/") and k.endswith("/mean")})
    for name, color in zip(names, SERIES_COLORS[1:] * 4):
        points = _points(rows, name)
        if points:
            ax.plot(*zip(*points), color=color, linewidth=1.0, alpha=0.8, label=name.split("/")[1])
    length_ax = _second_axis(ax)
    if length:
        length_ax.plot(*zip(*length), color=ACCURACY_COLOR, linestyle="--", linewidth=1.2, label="answer length")
    _label_both(ax, length_ax, "reward", "answer length (tokens)")
    _title(ax, title)
    return fig


# -- the standard views: one per run, one comparing runs ---------------------------------------


def run_figure(name: str, rows: list[dict]) -> Figure:
    """A run's loss (with eval points) and throughput over the steps, side by side; a preference run's
    reward margin and accuracy, or a GRPO run's reward and answer length, in a third panel."""
    third = preference_chart if is_preference(rows) else reward_chart if is_rewarded(rows) else None
    fig = WorkbenchFigure(figsize=(18 if third else 12, 3.6), dpi=110, layout="constrained")
    panels = fig.subplots(1, 3 if third else 2)
    curves({name: rows}, "loss", f"Loss: {name}", "loss", eval_key="eval_loss", ax=panels[0])
    curves({name: rows}, "tokens_per_s", "Throughput", "tokens/s", ax=panels[1])
    if third:
        third(rows, ax=panels[2])
    return fig


def compare_figure(rows: list[dict], series: dict[str, list[dict]]) -> Figure:
    """Peak memory (measured beside predicted), throughput and loss curves of several runs."""
    fig = WorkbenchFigure(figsize=(16, 3.8), dpi=110, layout="constrained")
    memory, speed, losses = fig.subplots(1, 3)
    compare_axes(rows, series, memory, speed, losses)
    return fig


def compare_axes(rows: list[dict], series: dict[str, list[dict]], memory=None, speed=None, losses=None):
    """The three comparison charts (the UI shows them one by one, the API side by side)."""
    return (run_bars(rows, [("peak_memory_mb", "measured"), ("predicted_peak_memory_mb", "predicted")],
                     "Peak memory", "MB", ax=memory),
            run_bars(rows, [("tokens_per_s", "tokens/s")], "Throughput", "tokens/s", ax=speed),
            curves(series, "loss", "Loss curves", "loss", eval_key="eval_loss", ax=losses))
