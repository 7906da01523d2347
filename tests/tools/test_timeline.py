"""Timelines from a replayed audit log: SVG (one row per request lifecycle) and Mermaid gantt."""

import json
import xml.etree.ElementTree as ET

from lifecycle_tools.replay import replay
from lifecycle_tools.timeline import COLORS, render_mermaid, render_svg, write_timeline
from tests.tools.test_replay import Log

SVG = "{http://www.w3.org/2000/svg}"


def many(n):
    log = Log()
    for i in range(n):
        rid = f"r{i}"
        log.chunk(rid, i + 1, 8, 12, row=i)
        log.release(rid, 14, row=i)
    return replay(log.lines())


def labels(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text for t in root.iter(f"{SVG}text") if t.get("text-anchor") == "end"]


def test_svg_has_one_row_per_request_and_a_legend():
    r = many(5)
    svg = render_svg(r, "five")
    assert labels(svg) == [f"r{i}" for i in range(5)]
    for name in COLORS:
        assert f">{name}<" in svg
    assert "copy in flight" in svg and "time since the first event (ms)" in svg
    fills = {e.get("fill") for e in ET.fromstring(svg).iter(f"{SVG}rect")}
    assert COLORS["PREFILLED"] in fills and COLORS["INFLIGHT"] in fills


def test_svg_caps_rows():
    svg = render_svg(many(30), max_rows=10)
    assert len(labels(svg)) == 10 and "20 more not drawn" in svg


def test_readmitted_generation_gets_its_own_row():
    log = Log().chunk("a", 1, 8, 12).release("a", 14)
    log.tr("a", "readmit", "RELEASED", "PREFILLED")
    log.chunk("a", 2, 8, 12, row=3, gen=1).release("a", 20, row=3, gen=1)
    svg = render_svg(replay(log.lines()))
    assert labels(svg) == ["a", "a#1"] and "stroke-dasharray" in svg


def test_mermaid_text(tmp_path):
    r = many(3)
    text = render_mermaid(r)
    assert text.startswith("gantt") and "dateFormat x" in text
    assert [line.strip() for line in text.splitlines() if line.strip().startswith("section")] == [
        "section r0", "section r1", "section r2"]
    out = write_timeline(r, tmp_path / "t.mmd")
    assert out.read_text() == text


def test_timeline_from_a_real_log(tmp_path, capsys):
    from lifecycle_tools.cli import main
    from tests.tools.test_replay import SMALL
    import subprocess
    import sys

    log = tmp_path / "a.jsonl"
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", *SMALL, "--requests", "6",
                           "--store", str(tmp_path / "s"), "--audit", str(log)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    svg_path = tmp_path / "t.svg"
    assert main(["audit", str(log), "--timeline", str(svg_path)]) == 0
    r = replay(log.read_text().splitlines())
    svg = svg_path.read_text()
    assert len(labels(svg)) == len(r.lifecycles) >= 6
    rids = {json.loads(s)["rid"] for s in log.read_text().splitlines() if '"rid"' in s}
    assert {x.split("#")[0] for x in labels(svg)} == rids
    assert main(["audit", str(log), "--timeline", str(tmp_path / "t.png")]) == 2


def test_a_truncated_timeline_fits_its_axis_to_the_rows_drawn():
    import re

    r = many(30)

    def span(svg):
        return float(re.search(r"copies, ([0-9.]+) ms", svg).group(1))

    full, cut = span(render_svg(r)), span(render_svg(r, max_rows=10))
    assert cut < full / 2, (cut, full)          # 10 of 30 sequential requests: about a third of the time
    assert "the axis covers the rows shown" in render_svg(r, max_rows=10)
    last_ms = max(int(n) for n in re.findall(r", (\d+), \d+$", render_mermaid(r, max_rows=10), re.M))
    assert last_ms <= cut + 1
