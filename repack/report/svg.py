"""Inline SVG charts for the HTML report: horizontal bars and x/y lines. Standard library only;
every chart is a self-contained <svg> element (no script, no external resource)."""

from __future__ import annotations

from html import escape
from typing import Callable, Sequence

PALETTE = ("#3b6fd8", "#e07b39", "#3a9d5d", "#c0455a", "#8a5cc2", "#2aa3a8", "#b8912f", "#6b7280")
FONT = 'font-family="system-ui, sans-serif" font-size="12"'
CHAR_W = 8  # px a character of FONT takes at most (digits and most letters take 7)
LABEL_CHARS = 44  # longer labels are shortened with an ellipsis (the full text is in a <title> tooltip)


def _short(label: str) -> str:
    return label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "\u2026"


def bars(rows: Sequence[tuple[str, float]], value_text: Callable[[float], str] = lambda v: f"{v:g}",
         color: str = PALETTE[0], width: int = 640) -> str:
    """A horizontal bar chart: one row per (label, value), longest bar = the largest value."""
    if not rows:
        return '<p class="empty">nothing to show</p>'
    row_h, label_w = 22, 8 + 7 * min(LABEL_CHARS, max(len(_short(label)) for label, _ in rows))
    value_w = 12 + CHAR_W * max(len(value_text(value)) for _, value in rows)  # the longest value text fits
    bar_w = max(120, width - label_w - value_w)
    top = max(value for _, value in rows) or 1
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + value_w}" '
             f'height="{row_h * len(rows) + 4}" role="img" {FONT}>']
    for i, (label, value) in enumerate(rows):
        y = i * row_h + 2
        length = max(1.0, bar_w * value / top) if value else 0.0
        parts.append(f'<g><title>{escape(label)}: {escape(value_text(value))}</title>'
                     f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{escape(_short(label))}</text>'
                     f'<rect x="{label_w}" y="{y + 3}" width="{length:.1f}" height="{row_h - 6}" fill="{color}"/>'
                     f'<text x="{label_w + length + 5:.1f}" y="{y + 15}">{escape(value_text(value))}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def lines(series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str,
          y_text: Callable[[float], str] = lambda v: f"{v:g}", y_max: float | None = None,
          width: int = 760, height: int = 300) -> str:
    """An x/y chart: one polyline with markers per series, a legend, axes with a few ticks."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return '<p class="empty">nothing to show</p>'
    left, right, top_pad, bottom = 70, 230, 12, 44
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    xs = sorted({x for x, _ in points})
    x_lo, x_hi = xs[0], xs[-1] if xs[-1] > xs[0] else xs[0] + 1
    y_hi = y_max if y_max is not None else (max(y for _, y in points) or 1) * 1.1

    def sx(x: float) -> float:
        return left + plot_w * (x - x_lo) / (x_hi - x_lo)

    def sy(y: float) -> float:
        return top_pad + plot_h * (1 - y / y_hi)

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" {FONT}>',
             f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{left + plot_w}" y2="{top_pad + plot_h}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{top_pad + plot_h}" stroke="#444"/>']
    for i in range(5):
        y = y_hi * i / 4
        parts.append(f'<line x1="{left}" y1="{sy(y):.1f}" x2="{left + plot_w}" y2="{sy(y):.1f}" stroke="#e5e7eb"/>'
                     f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{escape(y_text(y))}</text>')
    for x in xs:
        parts.append(f'<text x="{sx(x):.1f}" y="{top_pad + plot_h + 16}" text-anchor="middle">{x:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(x_label)}</text>'
                 f'<text x="14" y="{top_pad + plot_h / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top_pad + plot_h / 2:.1f})">{escape(y_label)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = sorted(pts)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2.5"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="{color}">'
                  f'<title>{escape(name)}: {x:g} -> {escape(y_text(y))}</title></circle>' for x, y in pts]
        ly = top_pad + 10 + 18 * i
        parts.append(f'<rect x="{left + plot_w + 14}" y="{ly - 9}" width="12" height="12" fill="{color}"/>'
                     f'<text x="{left + plot_w + 32}" y="{ly + 2}">{escape(_short(name))}</text>')
    parts.append("</svg>")
    return "".join(parts)
