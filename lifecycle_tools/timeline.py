"""Per-request timelines from a replayed audit log: a hand-written SVG, or Mermaid gantt text.

One row per request lifecycle (a readmitted request's generations get a row each, ``rid#gen``),
sorted by start. The row's bar is coloured by state over time; under it a green bar per D2H copy in
flight (``chunk_enqueued`` -> ``chunk_landed``), over it a purple bar per storage write
(``chunk_landed`` -> ``stored``); a dark tick marks the release. Rows with a violation have a red
label. The axis is in milliseconds from the first event drawn. Beyond ``max_rows`` rows the rest
are counted in the title, not drawn, and the axis spans only the rows drawn (the SVG grows
downwards, so a browser scrolls it).
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from lifecycle_tools.replay import INITIAL_NAME, RELEASED_NAME, Replay

COLORS = {
    "PREFILLED": "#a6cee3",
    "OFFLOADING": "#ff7f00",
    "INFLIGHT": "#1f78b4",
    "FINISHED": "#fb9a99",
}
COPY_COLOR = "#33a02c"
STORE_COLOR = "#8e6bbf"
RELEASE_COLOR = "#222222"
BAD_COLOR = "#d62728"

LABEL_W, PLOT_W, RIGHT = 150, 960, 24
ROW_H, BAR_H, TOP, BOTTOM = 18, 10, 78, 40


def _ticks(span_ms: float, target: int = 10) -> list[float]:
    if span_ms <= 0:
        return [0.0]
    raw = span_ms / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    n = int(span_ms // step)
    return [i * step for i in range(n + 1)]


def _fmt_ms(v: float) -> str:
    return f"{v:.0f}" if v >= 10 or v == 0 else f"{v:.3g}"


def _rows(r: Replay, max_rows: int):
    lives = sorted(r.lifecycles, key=lambda life: (life.start_t, life.first_line))
    return lives[:max_rows], max(0, len(lives) - max_rows)


def _span(r: Replay, lives, hidden: int) -> tuple[float, float]:
    """The time axis: the whole log, or (rows left out) just what the drawn rows cover."""
    t0 = r.t0 or 0.0
    t1 = r.t1 if r.t1 is not None else t0
    if not hidden or not lives:
        return t0, t1
    times = [t for life in lives for t, _ in life.history]
    times += [t for life in lives for c in life.chunks for t in (c.enq_t, c.landed_t, c.stored_t) if t is not None]
    open_ended = any(life.end_t is None for life in lives)
    return min(times), (t1 if open_ended else max(times))


def _segments(life, t_end: float):
    """(state, t_from, t_to) spans, the last open one closed at ``t_end``."""
    hist = life.history
    out = []
    for (t, state), nxt in zip(hist, hist[1:] + [None]):
        if state == RELEASED_NAME:
            break
        if life.readmitted and state == INITIAL_NAME and nxt is None and len(hist) > 1:
            break  # a readmitted generation: its new life is on another row
        out.append((state, t, nxt[0] if nxt is not None else t_end))
    return out


class _Plot:
    """Maps times to x: ``t0`` at the plot's left edge, ``span_ms`` across its width."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.span_ms = max((t1 - t0) * 1000, 1e-3)

    def x(self, t: float) -> float:
        return LABEL_W + (t - self.t0) * 1000 / self.span_ms * PLOT_W


def _legend() -> list[str]:
    o, lx = [], 10
    items = [(n, c, "bar") for n, c in COLORS.items()] + [
        ("copy in flight (D2H)", COPY_COLOR, "thin"), ("storage write", STORE_COLOR, "thin"),
        ("released", RELEASE_COLOR, "tick"), ("retracted, waiting to be readmitted", "#888", "dash")]
    for name, color, kind in items:
        if kind == "bar":
            o.append(f'<rect x="{lx}" y="44" width="14" height="{BAR_H}" fill="{color}"/>')
        elif kind == "thin":
            o.append(f'<rect x="{lx}" y="47" width="14" height="4" fill="{color}"/>')
        elif kind == "dash":
            o.append(f'<line x1="{lx}" y1="49" x2="{lx + 14}" y2="49" stroke="{color}" stroke-dasharray="3,2"/>')
        else:
            o.append(f'<rect x="{lx + 6}" y="42" width="2" height="14" fill="{color}"/>')
        o.append(f'<text x="{lx + 18}" y="53">{escape(name)}</text>')
        lx += 30 + 7.0 * len(name)
    return o


def _axis(plot: _Plot, rows: int) -> list[str]:
    o, span_ms = [], plot.span_ms
    plot_top, plot_bot = TOP - 6, TOP + ROW_H * max(rows, 1)
    for v in _ticks(span_ms):
        gx = LABEL_W + v / span_ms * PLOT_W
        o.append(f'<line x1="{gx:.1f}" y1="{plot_top}" x2="{gx:.1f}" y2="{plot_bot}" stroke="#e3e3e3"/>')
        o.append(f'<text x="{gx:.1f}" y="{plot_top - 3}" text-anchor="middle" fill="#555" font-size="10">{_fmt_ms(v)}</text>')
        o.append(f'<text x="{gx:.1f}" y="{plot_bot + 13}" text-anchor="middle" fill="#555" font-size="10">{_fmt_ms(v)}</text>')
    o.append(f'<text x="{LABEL_W + PLOT_W / 2}" y="{plot_bot + 30}" text-anchor="middle" fill="#333">'
             'time since the first event (ms)</text>')
    return o


def _copies(life, plot: _Plot, yb: float) -> list[str]:
    o, x = [], plot.x
    for c in life.chunks:
        b = c.landed_t if c.landed_t is not None else plot.t1
        tip = f"{life.label}: copy ack {c.ack_id} [{c.start}, {c.end}) {(b - c.enq_t) * 1e3:.2f} ms"
        o.append(f'<rect x="{x(c.enq_t):.2f}" y="{yb + BAR_H - 1:.1f}" width="{max(x(b) - x(c.enq_t), 1.0):.2f}" '
                 f'height="4" fill="{COPY_COLOR}"><title>{escape(tip)}</title></rect>')
        if c.landed_t is not None and c.stored_t is not None:
            w = max(x(c.stored_t) - x(c.landed_t), 1.0)
            tip = f"{life.label}: storage of ack {c.ack_id} {(c.stored_t - c.landed_t) * 1e3:.2f} ms"
            o.append(f'<rect x="{x(c.landed_t):.2f}" y="{yb - 3:.1f}" width="{w:.2f}" height="4" '
                     f'fill="{STORE_COLOR}"><title>{escape(tip)}</title></rect>')
    return o


def _row(i: int, life, plot: _Plot, width: int, bad: bool) -> list[str]:
    o, x, t0 = [], plot.x, plot.t0
    y = TOP + i * ROW_H
    yb = y + (ROW_H - BAR_H) / 2
    if i % 2:
        o.append(f'<rect x="0" y="{y}" width="{width}" height="{ROW_H}" fill="#f7f7f7" fill-opacity="0.6"/>')
    label = life.label if len(life.label) <= 22 else life.label[:21] + "…"
    o.append(f'<text x="{LABEL_W - 6}" y="{y + ROW_H - 5}" text-anchor="end" fill="{BAD_COLOR if bad else "#222"}">'
             f'{escape(label)}</text>')
    for state, a, b in _segments(life, life.end_t if life.end_t is not None else plot.t1):
        w = max(x(b) - x(a), 0.6 if state != "OFFLOADING" else 1.0)
        tip = f"{life.label}: {state} {(a - t0) * 1e3:.2f} - {(b - t0) * 1e3:.2f} ms"
        o.append(f'<rect x="{x(a):.2f}" y="{yb:.1f}" width="{w:.2f}" height="{BAR_H}" '
                 f'fill="{COLORS.get(state, "#999")}"><title>{escape(tip)}</title></rect>')
    o += _copies(life, plot, yb)
    if life.end_t is not None:
        back = life.history[-1][0]
        if life.readmitted and back > life.end_t:
            tip = f"{life.label}: released (retracted), readmitted {(back - life.end_t) * 1e3:.1f} ms later"
            o.append(f'<line x1="{x(life.end_t):.2f}" y1="{y + ROW_H / 2:.1f}" x2="{x(back):.2f}" '
                     f'y2="{y + ROW_H / 2:.1f}" stroke="#888" stroke-dasharray="3,2"><title>{escape(tip)}</title></line>')
        o.append(f'<rect x="{x(life.end_t) - 1:.2f}" y="{y + 2}" width="2" height="{ROW_H - 4}" '
                 f'fill="{RELEASE_COLOR}"><title>{escape(life.label)} released</title></rect>')
    return o


def render_svg(r: Replay, title: str = "kv-lifecycle timeline", max_rows: int = 100) -> str:
    """The timeline as an SVG document (a string)."""
    lives, hidden = _rows(r, max_rows)
    plot = _Plot(*_span(r, lives, hidden))
    width = LABEL_W + PLOT_W + RIGHT
    height = TOP + ROW_H * max(len(lives), 1) + BOTTOM
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11">',
         f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>']
    sub = f"{len(r.lifecycles)} lifecycles, {len(r.chunks)} copies, {plot.span_ms:.1f} ms"
    if hidden:
        sub += f" — first {len(lives)} shown, {hidden} more not drawn; the axis covers the rows shown"
    if r.violations:
        sub += f" — {len(r.violations)} violations"
    o.append(f'<text x="10" y="18" font-size="14" font-weight="bold">{escape(title)}</text>')
    o.append(f'<text x="10" y="34" fill="#444">{escape(sub)}</text>')
    o += _legend() + _axis(plot, len(lives))
    bad_rids = {v.rid for v in r.violations}
    for i, life in enumerate(lives):
        o += _row(i, life, plot, width, life.rid in bad_rids)
    o.append("</svg>")
    return "\n".join(s for s in o if s) + "\n"


def render_mermaid(r: Replay, title: str = "kv-lifecycle timeline", max_rows: int = 100) -> str:
    """The timeline as Mermaid gantt text (ms since the first event; spans under 1 ms omitted)."""
    lives, hidden = _rows(r, max_rows)
    t0, t1 = _span(r, lives, hidden)
    tags = {"PREFILLED": "done", "OFFLOADING": "active", "INFLIGHT": "active", "FINISHED": "crit"}

    def ms(t: float) -> int:
        return int(round((t - t0) * 1000))

    out = ["gantt", f"    title {title}" + (f" (first {len(lives)}, {hidden} more not shown)" if hidden else ""),
           "    dateFormat x", "    axisFormat %S.%L s"]
    for life in lives:
        out.append(f"    section {life.label}")
        merged: list[list] = []
        for state, a, b in _segments(life, life.end_t if life.end_t is not None else t1):
            if merged and merged[-1][0] == state:
                merged[-1][2] = b
            else:
                merged.append([state, a, b])
        for state, a, b in merged:
            if ms(b) - ms(a) >= 1:
                out.append(f"    {state} :{tags.get(state, 'done')}, {ms(a)}, {ms(b)}")
        for c in life.chunks:
            if c.landed_t is not None and ms(c.landed_t) - ms(c.enq_t) >= 1:
                out.append(f"    copy {c.ack_id} :{ms(c.enq_t)}, {ms(c.landed_t)}")
        if life.end_t is not None:
            out.append(f"    released :milestone, {ms(life.end_t)}, 0ms")
    return "\n".join(out) + "\n"


def write_timeline(r: Replay, path, title: str | None = None, max_rows: int = 100) -> Path:
    """Write ``path`` (``.svg`` or ``.mmd``). Raises ValueError for another suffix."""
    path = Path(path)
    title = title or "kv-lifecycle timeline"
    if path.suffix.lower() == ".svg":
        text = render_svg(r, title, max_rows)
    elif path.suffix.lower() in (".mmd", ".mermaid"):
        text = render_mermaid(r, title, max_rows)
    else:
        raise ValueError(f"timeline must end in .svg or .mmd, got {str(path)!r}")
    path.write_text(text, encoding="utf-8")
    return path
