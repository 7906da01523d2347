"""Diagrams and the state-table doc, generated from the module-level machine's markup export.

Nothing here is drawn by hand: ``transitions``' ``MarkupMachine`` exports the machine built from
``lifecycle.states.TRANSITIONS`` (the same table, callbacks and guards as ``lifecycle.machine``),
and Mermaid, Graphviz DOT and the Markdown state table are rendered from that export.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from transitions import Event
from transitions.extensions.markup import MarkupMachine

from lifecycle.machine import build_machine
from lifecycle.states import REFUSALS, TERMINAL, State

STEM = "request_lifecycle"
HEADER = "generated from lifecycle.machine by `kv-lifecycle diagrams`; do not edit"
DOC_BEGIN, DOC_END = "<!-- generated:state-table -->", "<!-- /generated:state-table -->"

_STATE_NOTES = {
    State.PREFILLED: "holds GPU slots; nothing in flight",
    State.OFFLOADING: "a chunk is being handed to the offloader (transient)",
    State.INFLIGHT: "GPU -> host copies still read its slots",
    State.FINISHED: "done; release waits for copies in flight",
    State.RELEASED: "slots and row freed (terminal; only readmit leaves it)",
}


def markup() -> dict:
    """The machine's markup export (states, transitions with guards and callbacks, initial)."""
    return build_machine(event_cls=Event, machine_cls=MarkupMachine).markup


def _guard(t: dict) -> str:
    parts = list(t.get("conditions", [])) + [f"!{u}" for u in t.get("unless", [])]
    return f" [{' & '.join(parts)}]" if parts else ""


def to_mermaid(mk: dict | None = None) -> str:
    """Mermaid ``stateDiagram-v2`` text (renders on GitHub)."""
    mk = mk or markup()
    lines = ["---", "title: Request KV lifecycle", "---", f"%% {HEADER}", "stateDiagram-v2",
             "    direction LR", f"    [*] --> {mk['initial']}"]
    for t in mk["transitions"]:
        lines.append(f"    {t['source']} --> {t['dest']}: {t['trigger']}{_guard(t)}")
    lines.append(f"    {TERMINAL.name} --> [*]")
    lines.append("    classDef initial fill:#dff0d8,stroke:#3c763d")
    lines.append("    classDef terminal fill:#e8e8e8,stroke:#333,stroke-width:3px")
    lines.append(f"    class {mk['initial']} initial")
    lines.append(f"    class {TERMINAL.name} terminal")
    return "\n".join(lines) + "\n"


def to_dot(mk: dict | None = None) -> str:
    """Graphviz DOT source: the initial state entered from a dot, the terminal doubly outlined."""
    mk = mk or markup()
    lines = [f"// {HEADER}", "digraph request_lifecycle {",
             '    rankdir=LR; labelloc=t; label="Request KV lifecycle"; fontname="Helvetica";',
             '    node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica"];',
             '    edge [fontname="Helvetica", fontsize=10];',
             '    __start [shape=point, width=0.2, label="", fillcolor=black];']
    for s in mk["states"]:
        name = s["name"]
        attrs = [f'tooltip="{_STATE_NOTES[State[name]]}"']
        if name == mk["initial"]:
            attrs.append('fillcolor="#dff0d8"')
        if name == TERMINAL.name:
            attrs += ["peripheries=2", 'fillcolor="#e8e8e8"']
        lines.append(f"    {name} [{', '.join(attrs)}];")
    lines.append(f"    __start -> {mk['initial']};")
    for t in mk["transitions"]:
        lines.append(f'    {t["source"]} -> {t["dest"]} [label="{t["trigger"]}{_guard(t)}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_source: str) -> str | None:
    """SVG rendered by Graphviz's ``dot``, or None when it is not installed."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    out = subprocess.run([exe, "-Tsvg"], input=dot_source, capture_output=True, text=True, check=True)
    return out.stdout


def state_table_md(mk: dict | None = None) -> str:
    """The Markdown state and transition tables for docs/states.md."""
    mk = mk or markup()
    rows = ["| state | meaning |", "|---|---|"]
    for s in mk["states"]:
        name = s["name"]
        mark = " (initial)" if name == mk["initial"] else " (terminal)" if name == TERMINAL.name else ""
        rows.append(f"| `{name}`{mark} | {_STATE_NOTES[State[name]]} |")
    rows += ["", "| trigger | from | to | guard | work (callbacks) |", "|---|---|---|---|---|"]
    for t in mk["transitions"]:
        work = ", ".join([f"before: `{b}`" for b in t.get("before", [])] + [f"after: `{a}`" for a in t.get("after", [])])
        guard = _guard(t).strip(" []") or "-"
        rows.append(f"| `{t['trigger']}` | {t['source']} | {t['dest']} | {guard} | {work or '-'} |")
    rows += ["", "| refused | when | the bug it prevents |", "|---|---|---|"]
    for r in REFUSALS:
        rows.append(f"| `{r.trigger}` | {r.when} | {r.bug} |")
    return "\n".join(rows) + "\n"


class DocProblem(ValueError):
    """The state-table doc cannot be refreshed (markers missing or out of order, not text)."""


def check_states_doc(path: Path) -> str:
    """The doc's text, after checking it holds one generated block (``DOC_BEGIN`` then ``DOC_END``).

    Raises:
        DocProblem: a marker is missing, repeated or out of order, or the file is not UTF-8 text.
        OSError: it cannot be read.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DocProblem(f"{str(path)!r} is not UTF-8 text") from None
    begin, end = text.count(DOC_BEGIN), text.count(DOC_END)
    if begin != 1 or end != 1 or text.index(DOC_BEGIN) > text.index(DOC_END):
        raise DocProblem(f"{str(path)!r} needs exactly one {DOC_BEGIN} ... {DOC_END} block for the generated "
                         f"state table (found {begin} begin and {end} end markers); nothing written")
    return text


def refresh_states_doc(path: Path) -> bool:
    """Rewrite the generated block of docs/states.md; returns True when it changed.

    Raises:
        DocProblem: see ``check_states_doc`` (nothing is written then).
    """
    text = check_states_doc(path)
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    new = f"{head}{DOC_BEGIN}\n{state_table_md()}{DOC_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def write_diagrams(out_dir: Path | str = "diagrams") -> list[Path]:
    """Write ``request_lifecycle.{mmd,dot,svg}``; the SVG only when Graphviz's ``dot`` exists.

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mk = markup()
    written = []
    for suffix, text in (("mmd", to_mermaid(mk)), ("dot", to_dot(mk))):
        path = out / f"{STEM}.{suffix}"
        path.write_text(text)
        written.append(path)
    svg = render_svg(to_dot(mk))
    if svg is not None:
        path = out / f"{STEM}.svg"
        path.write_text(svg)
        written.append(path)
    return written
