"""The usage charts of the finance page, laid out as plain numbers (bars, ticks, a polyline) for
the templates to draw as inline SVG: no script, no chart library."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

MAX_HOUR_BUCKETS = 96  # beyond this the bar chart groups by day
MAX_BAR_WIDTH = 44.0
STACKS = ("tenant", "model", "kind")
# Okabe-Ito, readable by colour-blind readers; cycles past eight series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999")
KIND_COLOURS = {"prompt (uncached)": "#0072B2", "cached": "#56B4E9", "completion": "#E69F00"}
# The amount lines, one per currency: dark tones the bars' palette does not use, each with its
# own dash so that two lines differ without their colour; cycles past four currencies.
AMOUNT_STYLES = (("#b3261e", ""), ("#5e3c99", "7 4"), ("#1b7837", "2 3"), ("#7f3b08", "9 3 2 3"))


def money(micros: int | None) -> str:
    """Integer micro-units as the decimal string every page shows (the templates' `money`
    filter too: it lives here because the chart tooltips need it and web.py imports charts)."""
    if micros is None:
        return "—"
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(int(micros)), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    colour: str
    title: str


@dataclass
class Tick:
    pos: float
    label: str


@dataclass
class Series:
    name: str
    colour: str
    points: str  # polyline points
    dots: list[tuple[float, float, str]] = field(default_factory=list)
    dash: str = ""  # stroke-dasharray: lines told apart without their colour
    label_at: tuple[float, float] = (0.0, 0.0)  # where the name is written, by the last point


@dataclass
class Chart:
    """An SVG chart already laid out: the template only draws what is here."""

    width: int
    height: int
    plot: tuple[float, float, float, float]  # left, top, right, bottom
    bars: list[Bar] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    y2_ticks: list[Tick] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    amounts: list[Series] = field(default_factory=list)  # one line per currency
    legend: list[tuple[str, str]] = field(default_factory=list)
    y_label: str = ""
    y2_label: str = ""
    empty: bool = False


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exp:
            return step * exp
    return 10 * exp


def _compact(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def _floor_hour(iso: str) -> datetime:
    when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return when.replace(minute=0, second=0, microsecond=0)


def _series_key(row: dict[str, Any], stack: str) -> list[tuple[str, int]]:
    if stack == "kind":
        cached = int(row["cached_tokens"])
        return [("prompt (uncached)", int(row["prompt_tokens"]) - cached), ("cached", cached),
                ("completion", int(row["completion_tokens"]))]
    label = row["tenant"] if stack == "tenant" else row["model"]
    return [(label, int(row["prompt_tokens"]) + int(row["completion_tokens"]))]


def time_chart(rows: list[dict[str, Any]], stack: str) -> tuple[Chart, str]:
    """Stacked bars of tokens per hour (or per day when the span is long), stacked by tenant,
    model or token kind, with the billed amount as a line on the right axis: one line per
    currency, named by its code, since amounts in two currencies are never summed (one right
    axis for all: each line's numbers are in its own currency). The axis runs from the first
    hour (day) with data to the last, quiet ones between them drawn as zero: an hour of data is
    one bar, not a day of empty hours around it."""
    width, height = 1160, 340
    left, top, right, bottom = 78.0, 18.0, width - 86.0, height - 46.0
    chart = Chart(width, height, (left, top, right, bottom), y_label="tokens",
                  y2_label="amount")
    if not rows:
        chart.empty = True
        return chart, "hour"
    hours = [_floor_hour(r["period_start"]) for r in rows]
    first, last = min(hours), max(hours)
    span_hours = int((last - first).total_seconds() // 3600) + 1
    unit = "hour" if span_hours <= MAX_HOUR_BUCKETS else "day"
    step = timedelta(hours=1) if unit == "hour" else timedelta(days=1)
    if unit == "day":
        first = first.replace(hour=0)
        last = last.replace(hour=0)
    buckets: list[datetime] = []
    cursor = first
    while cursor <= last:
        buckets.append(cursor)
        cursor += step
    index = {b: i for i, b in enumerate(buckets)}
    values: dict[str, list[int]] = defaultdict(lambda: [0] * len(buckets))
    amounts: dict[str, list[int]] = defaultdict(lambda: [0] * len(buckets))  # by currency
    for row, hour in zip(rows, hours, strict=True):
        i = index[hour if unit == "hour" else hour.replace(hour=0)]
        for name, tokens in _series_key(row, stack):
            values[name][i] += tokens
        amounts[row["currency"]][i] += int(row["amount_micros"])
    names = list(KIND_COLOURS) if stack == "kind" else sorted(values)
    colours = {
        name: KIND_COLOURS.get(name) or PALETTE[n % len(PALETTE)] for n, name in enumerate(names)
    }
    chart.legend = [(name, colours[name]) for name in names]
    totals = [sum(values[name][i] for name in names) for i in range(len(buckets))]
    y_max = _nice_max(max(totals))
    a_max = _nice_max(max(max(line) for line in amounts.values()) / 1e6)
    plot_w, plot_h = right - left, bottom - top
    slot = plot_w / len(buckets)
    bar_w = min(MAX_BAR_WIDTH, max(1.0, slot * 0.72))
    label = "%Y-%m-%d %H:00" if unit == "hour" else "%Y-%m-%d"
    for i, when in enumerate(buckets):
        x = left + i * slot + (slot - bar_w) / 2
        base = bottom
        for name in names:
            v = values[name][i]
            if v <= 0:
                continue
            h = v / y_max * plot_h
            base -= h
            chart.bars.append(Bar(round(x, 2), round(base, 2), round(bar_w, 2), round(h, 2),
                                  colours[name],
                                  f"{when.strftime(label)} · {name}: {v:,} tokens"))
    for n, currency in enumerate(sorted(amounts)):
        colour, dash = AMOUNT_STYLES[n % len(AMOUNT_STYLES)]
        series = Series(currency, colour, "", dash=dash)
        points = []
        for i, amount in enumerate(amounts[currency]):
            cx = left + i * slot + slot / 2
            cy = bottom - (amount / 1e6) / a_max * plot_h
            points.append(f"{cx:.2f},{cy:.2f}")
            series.dots.append((round(cx, 2), round(cy, 2),
                                f"{buckets[i].strftime(label)} · amount {money(amount)} "
                                f"{currency}"))
        series.points = " ".join(points)
        last_x, last_y, _ = series.dots[-1]
        label_y = max(top + 10, last_y - 8)
        while any(abs(label_y - other.label_at[1]) < 12 for other in chart.amounts):
            label_y += 13  # two lines ending together: their names one above the other
        series.label_at = (last_x, round(label_y, 2))
        chart.amounts.append(series)
    chart.y2_label = f"amount ({', '.join(s.name for s in chart.amounts)})"
    decimals = max(2, min(6, math.ceil(-math.log10(a_max)) + 2))
    for k in range(5):
        frac = k / 4
        y = bottom - frac * plot_h
        chart.y_ticks.append(Tick(round(y, 2), _compact(y_max * frac)))
        chart.y2_ticks.append(Tick(round(y, 2), f"{a_max * frac:.{decimals}f}"))
    stride = max(1, math.ceil(len(buckets) / 10))
    tick_format = "%m-%d %H:00" if unit == "hour" else "%m-%d"
    for i in range(0, len(buckets), stride):
        chart.x_ticks.append(Tick(round(left + i * slot + slot / 2, 2),
                                  buckets[i].strftime(tick_format)))
    return chart, unit


def totals_chart(summary: list[dict[str, Any]]) -> Chart:
    """Horizontal bars: billed amount per tenant and model over the range."""
    row_h, width = 26, 1160
    left, right = 330.0, width - 150.0
    height = int(30 + row_h * max(1, len(summary)))
    chart = Chart(width, height, (left, 10.0, right, height - 20.0))
    if not summary:
        chart.empty = True
        return chart
    a_max = max(int(r["amount_micros"]) for r in summary) or 1
    tenants = sorted({r["tenant"] for r in summary})
    colours = {t: PALETTE[n % len(PALETTE)] for n, t in enumerate(tenants)}
    for i, r in enumerate(summary):
        y = 10 + i * row_h
        w = max(1.0, (right - left) * int(r["amount_micros"]) / a_max)
        chart.bars.append(Bar(left, y + 4, round(w, 2), row_h - 8, colours[r["tenant"]],
                              f"{r['tenant']} · {r['model']}: {money(r['amount_micros'])} "
                              f"{r['currency']} ({r['prompt_tokens'] + r['completion_tokens']:,} "
                              f"tokens, {r['requests']:,} requests)"))
        chart.y_ticks.append(Tick(y + row_h / 2, f"{r['tenant']} · {r['model']}"))
        chart.x_ticks.append(Tick(y + row_h / 2, f"{money(r['amount_micros'])} {r['currency']}"))
    chart.legend = [(t, colours[t]) for t in tenants]
    return chart


@dataclass
class LineChart:
    width: int
    height: int
    plot: tuple[float, float, float, float]
    series: list[Series] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    empty: bool = False


def goodput_chart(rows: list[dict[str, Any]]) -> LineChart:
    """Goodput (attained / offered) per tier and hour, one line per tier, 0–100 %: rows are
    `ledger goodput` grouped by tier and hour."""
    width, height = 1160, 260
    left, top, right, bottom = 78.0, 18.0, width - 40.0, height - 46.0
    chart = LineChart(width, height, (left, top, right, bottom))
    hours = sorted({r["hour"] for r in rows if r.get("goodput_ppm") is not None})
    if not hours:
        chart.empty = True
        return chart
    slot = (right - left) / max(1, len(hours) - 1) if len(hours) > 1 else 0.0
    x_of = {h: left + i * slot if len(hours) > 1 else (left + right) / 2
            for i, h in enumerate(hours)}
    every = max(1, len(hours) // 8)
    chart.x_ticks = [Tick(x_of[h], _floor_hour(h).strftime("%m-%d %H:00"))
                     for i, h in enumerate(hours) if i % every == 0]
    chart.y_ticks = [Tick(bottom - (bottom - top) * p / 100, f"{p}%") for p in (0, 25, 50, 75, 100)]
    tiers = sorted({r["tier"] for r in rows})
    for n, tier in enumerate(tiers):
        points, dots = [], []
        for r in sorted((r for r in rows if r["tier"] == tier and r.get("goodput_ppm") is not None),
                        key=lambda r: r["hour"]):
            x = x_of[r["hour"]]
            y = bottom - (bottom - top) * r["goodput_ppm"] / 1_000_000
            points.append(f"{x:.1f},{y:.1f}")
            dots.append((x, y, f"{tier} {r['hour']}: goodput {r['goodput_ppm'] / 1e4:.1f} %, "
                         f"attainment {(r['attainment_ppm'] or 0) / 1e4:.1f} % of "
                         f"{r['served']} served, {r['offered']} offered"))
        chart.series.append(Series(tier, PALETTE[n % len(PALETTE)], " ".join(points), dots))
    return chart
