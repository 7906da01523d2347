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
