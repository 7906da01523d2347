"""Ctrl-C is handled from the first instant of the ``kv-lifecycle`` command: exit 130, no traceback.

README: "130 Ctrl-C (the command stops within a second)". A Ctrl-C that comes while the command is
still starting (importing its modules, parsing flags, importing ``simulate``) must be handled like one
that comes mid-run. Each case runs the console script's own body (``from lifecycle_tools.cli import
main; sys.exit(main())``, with ``argv[0]`` the script's name) in a child interpreter whose import
hook sends the process SIGINT when a given module starts to import: the moment is exact, not timed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
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


# --- the installed command itself, real SIGINTs from outside --------------------------------------
#
# The child is the console script (and ``python -m lifecycle_tools``) as a user runs it; the parent
# synchronises on what the child writes, not on wall-clock guesses: with PYTHONPROFILEIMPORTTIME the
# interpreter writes a line to stderr as each import completes, so the line for ``lifecycle_tools``
# says the package's first lines have run (what comes before is the interpreter's own start-up, see
# docs/reliability.md). SIGINT then comes 0 s to 1 s later: during the imports, flag parsing, torch's
# import, the replay / the stack's construction, the run.

SCRIPT = Path(sys.executable).with_name("kv-lifecycle")
ENTRY_POINTS = {"console script": [str(SCRIPT)], "python -m": [sys.executable, "-m", "lifecycle_tools"]}
STOP_BOUND_S = 10.0      # generous: a hang, not a speed measurement (docs/reliability.md has the numbers)


def start(entry, argv, cwd, **env):
    assert SCRIPT.exists(), f"the console script {SCRIPT} is not installed (pip install -e .)"
    return subprocess.Popen([*ENTRY_POINTS[entry], *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1", **env})


def read_until(stream, matches, deadline_s=120.0):
    """Read ``stream`` line by line until ``matches(line)``; the lines read."""
    seen, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = stream.readline()
        assert line, f"the child ended first: {''.join(seen)[-2000:]}"
        seen.append(line)
        if matches(line):
            return seen
    raise AssertionError("the child never wrote the line waited for")


def package_started(line):
    return line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == "lifecycle_tools"


def interrupt(proc, before, delay_s):
    """SIGINT ``delay_s`` after the sync point, stderr read meanwhile (the child never waits on a
    full pipe); the seconds from the signal to the exit, stdout, stderr."""
    import threading

    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.append(proc.stderr.read()), daemon=True)
    reader.start()
    time.sleep(delay_s)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    took = time.monotonic() - t0
    reader.join(60)
    return took, proc.stdout.read(), "".join(before) + "".join(rest)


def assert_interrupted(proc, took, stdout, stderr):
    own = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert proc.returncode == 130, (proc.returncode, stdout[-2000:], own)
    assert own == ["kv-lifecycle: interrupted"], own          # one short line: no traceback, nothing else
    assert took < STOP_BOUND_S, took


@pytest.fixture(scope="module")
def long_log(tmp_path_factory):
    """An audit log whose replay takes seconds (100,000 transitions of distinct requests)."""
    path = tmp_path_factory.mktemp("log") / "long.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(100_000):
            f.write(f'{{"rid": "r{i}", "row": 0, "gen": 0, "trigger": "offload", "src": "PREFILLED", '
                    f'"dst": "OFFLOADING", "event": "lifecycle.transition", "t": {i * 1e-5:.5f}}}\n')
    return path


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_ctrl_c_at_any_point_of_simulate_exits_130_with_one_line(entry, delay_s, tmp_path):
    proc = start(entry, ["simulate", "--requests", "100000", "--arrival-rate", "0", "--store", str(tmp_path / "s"),
                         "--json", str(tmp_path / "r.json")], tmp_path)
    before = read_until(proc.stderr, package_started)
    took, stdout, stderr = interrupt(proc, before, delay_s)
    assert_interrupted(proc, took, stdout, stderr)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_ctrl_c_at_any_point_of_audit_exits_130_with_one_line(entry, delay_s, long_log, tmp_path):
    proc = start(entry, ["audit", str(long_log)], tmp_path)
    before = read_until(proc.stderr, package_started)
    took, stdout, stderr = interrupt(proc, before, delay_s)
    assert_interrupted(proc, took, stdout, stderr)


def test_ctrl_c_after_simulate_shows_progress_exits_130_with_one_line(tmp_path):
    """After the first output line (the progress bar: the run is serving)."""
    proc = start("console script", ["simulate", "--requests", "100000", "--arrival-rate", "0", "--progress",
                                    "--store", str(tmp_path / "s")], tmp_path)
    before = read_until(proc.stderr, lambda line: "done" in line and "step" in line)
    took, stdout, stderr = interrupt(proc, before, 0.0)
    assert proc.returncode == 130, (proc.returncode, stderr[-2000:])
    own = [ln for ln in stderr.replace("\r", "\n").splitlines()
           if ln.strip() and not ln.startswith("import time:") and "done" not in ln]
    assert own == ["kv-lifecycle: interrupted"], own
    assert took < STOP_BOUND_S, took


AT_THE_END = textwrap.dedent("""
    import atexit, os, signal, sys
    # a Ctrl-C that lands once the command has written its result, while the process ends
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))
    sys.argv = [os.path.join(os.path.dirname(sys.executable), "kv-lifecycle"), *sys.argv[1:]]
    from lifecycle_tools.cli import main
    sys.exit(main())
""")


@pytest.mark.parametrize("argv", [["diagrams", "--out", "d"], ["simulate", "--requests", "2"], ["--help"],
                                  ["simulate", "--requests", "0"]])
def test_ctrl_c_while_the_command_ends_exits_130_with_one_line(argv, tmp_path):
    """Not the interpreter's finalization, which restores SIGINT's default (death by the signal, no
    line) or drops it: the command's handler sees it to the last instant."""
    proc = subprocess.run([sys.executable, "-c", AT_THE_END, *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "kv-lifecycle: interrupted", proc.stderr


def test_the_command_ends_with_its_own_exit_code_and_its_atexit_hooks(tmp_path):
    code = textwrap.dedent("""
        import atexit, os, sys
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.argv = [os.path.join(os.path.dirname(sys.executable), "kv-lifecycle"), *sys.argv[1:]]
        from lifecycle_tools.cli import main
        sys.exit(main())
    """)
    for argv, rc in ((["diagrams", "--out", "d"], 0), (["simulate", "--requests", "0"], 2), (["--help"], 0)):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        assert proc.returncode == rc, (argv, proc.returncode, proc.stderr)
        assert proc.stdout.rstrip().endswith("atexit ran"), (argv, proc.stdout)
