"""Run one shutdown scenario in a process of its own and say, on stdout, every ``cudaHostUnregister``
of the host pool and whether it happened before or at interpreter exit (``weakref.finalize`` hooks
run then). The CUDA runtime is a stand-in (``FakeCudart``): the pool is "pinned" on a CPU machine.

    python -m tests.support.pinned_exit SCENARIO

Scenarios:
  unclosed         a pinned pool never closed (the process just ends)
  kept             a pinned pool left pinned with ``keep_pinned()``, then ``close()`` (must do nothing)
  sglang-abandoned SGLang's manager shut down with a copy still in flight (it never reports):
                   ``release_host_resources(timeout_s=0.01)``
  sglang-clean     the same with the copy landed (``timeout_s=60``, enough for its storage write):
                   the pool is unpinned once, at shutdown

Lines: ``unregister during-run`` / ``unregister at-exit``, ``pinned True|False`` after the
scenario's shutdown step, ``end of run`` when the script body is done.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from transfer import HostPool
from transfer import host_pool as host_pool_mod

PHASE = ["during-run"]
KEEP: list = []  # what the scenario built, alive until the interpreter exits (not collected first)


class FakeCudart:
    def cudaHostRegister(self, ptr, nbytes, flags):
        return 0

    def cudaHostUnregister(self, ptr):
        print(f"unregister {PHASE[0]}", flush=True)
        return 0

    def cudaGetErrorString(self, rc):
        return f"error {rc}"


def _sglang(abandoned: bool, store: str):
    from lifecycle_tools.testkit import sglang_doubles
    from tests.integrations.sglang_kit import Node, doubles_kit
    from tests.integrations.test_sglang import build

    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = store
    os.environ.pop("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", None)
    node = Node(doubles_kit(), page_size=4)
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # the manager's host pool pins (pin=None) on the stand-in
    try:
        mgr = build(node)
    finally:
        torch.cuda.is_available = real
    assert mgr.decode_host_mem_pool.pinned
    req = node.admit("r", list(range(4)), 30)
    node.decode_tokens(req, 4, 7)
    if abandoned:
        mgr.offloader.engine.poll = lambda: []  # the copy never reports: still in flight at shutdown
    assert mgr.offload_kv_cache(req)
    req.finished_reason = "abort"
    mgr.finalize_release_on_finish(req)
    # abandoned: a short bound the stuck copy outlives; clean: a generous one (the copy landed, its
    # storage write must finish within it even on a loaded machine)
    mgr.release_host_resources(timeout_s=0.01 if abandoned else 60.0)
    assert mgr.stats().abandoned == (1 if abandoned else 0), mgr.stats()
    del sglang_doubles
    return mgr


def run(scenario: str, tmp_path) -> list[str]:
    """Run ``scenario`` in a fresh interpreter; its stdout lines (asserting it exited 0)."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.support.pinned_exit", scenario, str(Path(tmp_path) / "hicache")],
                         cwd=root, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def main(scenario: str, store: str) -> None:
    host_pool_mod._cudart = lambda: FakeCudart()
    if scenario == "unclosed":
        pool = HostPool(1, 1, 4, torch.float32, 4, 8, pin=True)
        KEEP.append(pool)
    elif scenario == "kept":
        pool = HostPool(1, 1, 4, torch.float32, 4, 8, pin=True)
        pool.keep_pinned()
        pool.close()
        del pool  # held by the host pool module all the same
        pool = host_pool_mod._KEPT[-1]
    elif scenario in ("sglang-abandoned", "sglang-clean"):
        mgr = _sglang(scenario == "sglang-abandoned", store)
        pool = mgr.decode_host_mem_pool
        KEEP.append(mgr)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(f"pinned {pool.pinned}", flush=True)
    print("end of run", flush=True)
    PHASE[0] = "at-exit"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp/hicache-pinned-exit")
