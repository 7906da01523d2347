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


def test_the_prefix_reuse_example_for_embedders_is_run():
    """Issue 21: docs/integration.md shows prefix reuse with ``stack.prefix_loader`` (prompt pages
    stored first), as a block this module runs, not a sketch."""
    runnable = [b.values[0] for b in blocks() if b.id.startswith("integration.md:")]
    assert any("stack.prefix_loader.start(" in code and "store_prompt_pages(" in code for code in runnable)
