"""Ctrl-C is handled from the first instant of the ``kv-lifecycle`` command: exit 130, no traceback.

README: "130 Ctrl-C (the command stops within a second)". A Ctrl-C that comes while the command is
still starting (importing its modules, parsing flags, importing ``simulate``) must be handled like one
that comes mid-run. Each case runs the console script's own body (``from lifecycle_tools.cli import
main; sys.exit(main())``, with ``argv[0]`` the script's name) in a child interpreter whose import
hook sends the process SIGINT when a given module starts to import: the moment is exact, not timed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, signal, sys
    target, argv = sys.argv[1], sys.argv[2:]

    class SigintOnImport:
        def find_spec(self, name, path=None, target_=None):
            if name == target:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, SigintOnImport())
    sys.argv = [os.path.join(os.path.dirname(sys.executable), "kv-lifecycle"), *argv]
    from lifecycle_tools.cli import main
    sys.exit(main())
""")


def run_interrupted(target, *argv):
    proc = subprocess.run([sys.executable, "-c", CHILD, target, *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("target", ["lifecycle_tools.cli", "argparse", "lifecycle_tools.simulate.config",
                                    "lifecycle_tools.simulate_cmd"])
def test_ctrl_c_while_the_command_starts_exits_130_without_a_traceback(target, tmp_path):
    rc, stdout, stderr = run_interrupted(target, "simulate", "--requests", "4", "--json", str(tmp_path / "r.json"))
    assert rc == 130, (rc, stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "interrupted" in stderr
    assert not (tmp_path / "r.json").exists()         # stopped before any work


def test_ctrl_c_while_an_audit_starts_exits_130(tmp_path):
    log = tmp_path / "a.jsonl"
    log.write_text('{"event": "lifecycle.transition"}\\n')
    rc, _, stderr = run_interrupted("argparse", "audit", str(log))
    assert rc == 130 and "Traceback" not in stderr, stderr


def test_importing_the_tools_elsewhere_leaves_sigint_alone():
    code = ("import signal; before = signal.getsignal(signal.SIGINT); import lifecycle_tools.cli; "
            "assert signal.getsignal(signal.SIGINT) is before, signal.getsignal(signal.SIGINT)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
