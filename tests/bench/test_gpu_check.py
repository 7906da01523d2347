"""``bench/gpu_check.sh``: what can be checked without a GPU. It must say cleanly that there is
nothing to check here (exit 3, one line), and read pytest's summary line right."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_the_check_says_so_in_one_line_and_exits_3():
    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check | environment") and "no CUDA device" in lines[0]
    assert "SKIP" in lines[0] and out.stderr == ""


def test_without_the_projects_dependencies_the_check_says_how_to_install():
    env = dict(os.environ, PYTHON="/bin/false")
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "pip install" in out.stdout


def test_pytest_summary_counts():
    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import _counts

    assert _counts("...\n3 passed, 1 skipped, 2 deselected in 4.2s\n") == {"passed": 3, "skipped": 1, "deselected": 2}
    assert _counts("1 failed, 9 passed in 1s") == {"failed": 1, "passed": 9}
    assert _counts("") == {}


def test_every_point_of_issue_34_has_an_item_and_list_prints_them_without_a_gpu():
    """The script imports, names an item for each of issue 34's points (a 64-layer SGLang stack,
    offload timed with work queued, a chunk's launches, retract and resume under the staging cap, a
    repeated page, the stream, a held copy at shutdown), and ``--list`` prints every item (exit 0).
    The items themselves need a GPU: they cannot run here."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    assert list(gpu_check.SGLANG_ITEMS) == ["offload queued", "chunk launches", "retract resume", "repeated page",
                                            "own stream", "held copy exit"]
    assert set(gpu_check.SGLANG_ITEMS) <= set(gpu_check.ITEMS)
    for item in gpu_check.ITEMS:
        assert f"``{item}``" in gpu_check.__doc__, item
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--list"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == ""
    listed = [ln.split("|")[1].strip() for ln in out.stdout.splitlines()]
    assert listed == list(gpu_check.ITEMS)


def test_the_held_copy_item_fails_on_a_raise_an_unpin_or_an_unregister_at_exit():
    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import held_copy_verdict

    assert held_copy_verdict(0, "raised no\npinned True abandoned 1\n")
    assert not held_copy_verdict(0, "raised no\npinned True abandoned 1\nunregister at-exit\n")
    assert not held_copy_verdict(0, "raised RuntimeError('x')\npinned True abandoned 1\n")
    assert not held_copy_verdict(0, "unregister during-run\nraised no\npinned False abandoned 1\n")
    assert not held_copy_verdict(1, "raised no\npinned True abandoned 1\n")


def test_the_vllm_item_says_skip_without_vllm_and_is_neither_passed_nor_failed(monkeypatch, capsys):
    """Issue 37's GPU item: without vLLM it prints SKIP and returns None (``main`` leaves it out of the
    count, so a skip never counts as a pass); the engine run itself needs vLLM and, here, a GPU."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    monkeypatch.setitem(sys.modules, "vllm", None)   # `import vllm` raises ImportError
    ran = []
    monkeypatch.setattr(gpu_check, "_pytest", lambda *a, **k: ran.append(a) or (0, "1 passed"))
    assert gpu_check.vllm_engine(timeout=1) is None
    assert ran == []
    out = capsys.readouterr().out
    assert out.startswith("gpu_check | vllm engine") and "| SKIP |" in out and "vllm==0.32.0" in out


def test_the_vllm_item_fails_on_a_skipped_or_failed_engine_run(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("json"))   # importable: the run is asked for
    seen = {}

    def fake(args, timeout, env=None):
        seen["args"], seen["require"] = args, (env or {}).get("KV_LIFECYCLE_REQUIRE_VLLM")
        return fake.result

    monkeypatch.setattr(gpu_check, "_pytest", fake)
    fake.result = (0, "2 passed in 9s")
    assert gpu_check.vllm_engine(timeout=1) is True
    assert seen == {"args": ["tests/integrations/vllm/test_llm.py"], "require": "1"}
    for result in ((0, "1 passed, 1 skipped in 9s"), (1, "1 failed, 1 passed in 9s"), (0, "")):
        fake.result = result
        assert gpu_check.vllm_engine(timeout=1) is False, result
    capsys.readouterr()
