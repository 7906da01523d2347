"""Every ```python block in README.md and docs/*.md runs (blocks marked `<!-- not-run -->` are sketches)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- not-run -->\s*)?```python\n(.*?)```", re.S)


def blocks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, m in enumerate(BLOCK.finditer(path.read_text())):
            if not m.group(1):
                yield pytest.param(m.group(2), id=f"{path.name}:{i}")


@pytest.mark.parametrize("code", list(blocks()))
def test_doc_example_runs(code):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})


def test_there_are_examples():
    assert len(list(blocks())) >= 1
