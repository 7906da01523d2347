"""A writer process SIGKILLed mid-burst: the next FileStorage on the directory rebuilds its index,
ignores (then cleans) the dead writer's temp files, and returns only whole pages that verify."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.support.transfer_fault_writer import NB, SUFFIX, page_bytes, page_key
from transfer import FileStorage

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [11, 23, 57]


def _readline(proc: subprocess.Popen, deadline: float) -> str:
    # the writer prints a line per page (ms apart); a dead or silent writer fails the test
    line = proc.stdout.readline()
    if not line or time.monotonic() > deadline:
        raise AssertionError(f"writer stopped early (rc={proc.poll()}): {proc.stderr.read()}")
    return line.strip()


def test_sigkill_mid_burst_never_leaves_a_torn_or_unverified_page(tmp_path):
    dirs = [tmp_path / f"run{seed}" for seed in SEEDS]
    # start all writers at once (the import is the slow part), then run each burst in turn
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.transfer_fault_writer", str(d)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for d in dirs]
    try:
        deadline = time.monotonic() + 60
        for seed, d, proc in zip(SEEDS, dirs, procs):
            assert _readline(proc, deadline) == "ready"
            rng = random.Random(seed)
            kill_after, jitter = rng.randint(5, 40), rng.uniform(0, 0.002)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            while int(_readline(proc, deadline)) < kill_after:
                pass
            time.sleep(jitter)  # moves the kill point within the next write; asserts nothing
            os.kill(proc.pid, signal.SIGKILL)  # somewhere inside page kill_after + 1, + 2 ...
            proc.wait(10)
            assert proc.returncode == -signal.SIGKILL
            acked = kill_after  # every page up to this one had its batch_set return True

            store = FileStorage(d, SUFFIX, NB)  # rebuild; the dead writer's young temps are ignored
            n = store.stats().pages
            assert n >= acked + 1
            out = torch.empty(NB, dtype=torch.uint8)
            for i in range(n + 3):  # all indexed pages, and the ones the kill cut short
                got = store.batch_get([page_key(i)], [out])[0]
                if i <= acked:
                    assert got, f"acknowledged page {i} lost (seed {seed})"
                if got:
                    assert bytes(out.numpy()) == page_bytes(i), f"page {i} returned torn (seed {seed})"
            st = store.stats()
            assert st.corrupt == st.wrong_size == st.unverified == 0
            FileStorage(d, SUFFIX, NB, stale_temp_s=0)  # a later start removes the leftovers
            assert not [x for x in os.listdir(d) if x.endswith(".tmp")]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
