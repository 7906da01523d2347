"""Cross-process reuse through Mooncake: node A (another process, contributing no memory) decodes
and offloads a request and exits; its pages live on a standalone ``mooncake_client`` segment
holder, so node B's own stack finds the prefix and loads it bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from lifecycle_tools.testkit.mooncake_server import make_mooncake  # noqa: F401 (fixture)
from tests.support.cross_node_writer import MODEL
from tests.support.decode_driver import DIM, HEADS, LAYERS, MAX_LEN, PS, ROWS
from tests.support.transfer_helpers import drain
from transfer import build_stack, synthetic_kv

ROOT = Path(__file__).resolve().parents[2]


def test_second_process_loads_what_an_exited_first_process_stored(make_mooncake, tmp_path):
    master = make_mooncake()
    make_mooncake.holder(master)
    out = tmp_path / "node_a.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.support.cross_node_writer",
                           master.spec(global_segment_size=0), str(out)],
                          cwd=ROOT, env=env, capture_output=True, timeout=90)
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    a = json.loads(out.read_text())
    n_pages = a["kv_tokens"] // PS
    assert a["storage_failed"] == 0 and a["released"] == 1
    assert a["pages_stored"] == n_pages - a["prompt_pages"] >= 3

    b = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 256, 128, ROWS, MAX_LEN,
                    storage=master.spec(global_segment_size=0), model_name=MODEL)
    try:
        free0, host0 = b.allocator.available_size(), b.host_pool.available_size()
        follow_up = a["tokens"] + [1, 2, 3, 4, 5]
        assert len(b.prefix_loader.lookup(follow_up)) == n_pages
        assert b.prefix_loader.start(1, follow_up) == n_pages
        (done,) = drain(b.prefix_loader.finished, 1)
        assert done.pages == n_pages and done.error is None
        want = synthetic_kv(b.kv_pool, a["rid"], torch.arange(n_pages * PS))
        got = b.kv_pool.read(done.device_indices)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        b.allocator.free(done.device_indices)
        assert b.allocator.available_size() == free0 and b.host_pool.available_size() == host0
        st = b.storage.stats()
        assert st.hits == n_pages and st.corrupt == st.foreign == st.unverified == 0  # every page sealed
    finally:
        b.close()
