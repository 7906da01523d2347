"""Cross-node reuse through a shared Redis: node A (another process) decodes and offloads a
request; node B, with its own stack on the same server, finds the shared prefix and loads it
bit-exact into its own device pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.cross_node_writer import MODEL
from tests.support.decode_driver import DIM, HEADS, LAYERS, MAX_LEN, PS, ROWS
from tests.support.transfer_helpers import drain
from transfer import build_stack
from lifecycle_tools.testkit.kv_pattern import synthetic_kv

ROOT = Path(__file__).resolve().parents[2]


def test_node_b_reuses_what_node_a_stored(make_redis_server, tmp_path):
    server = make_redis_server()
    out = tmp_path / "node_a.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.support.cross_node_writer", server.url, str(out)],
                          cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    a = json.loads(out.read_text())
    n_pages = a["kv_tokens"] // PS
    assert a["storage_failed"] == 0 and a["released"] == 1
    assert a["pages_stored"] == n_pages - a["prompt_pages"] >= 3

    b = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 256, 128, ROWS, MAX_LEN,
                    storage=server.url, model_name=MODEL)
    try:
        free0, host0 = b.allocator.available_size(), b.host_pool.available_size()
        follow_up = a["tokens"] + [1, 2, 3, 4, 5]  # the next turn of the conversation
        assert len(b.prefix_loader.lookup(follow_up)) == n_pages
        # another rank's pages are not ours: the suffix keeps them apart
        other = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 16, 16, 1, 16, storage=server.url,
                            model_name=MODEL, tp_rank=1, tp_size=2)
        assert other.prefix_loader.lookup(follow_up) == []
        other.close()

        assert b.prefix_loader.start(1, follow_up) == n_pages
        (done,) = drain(b.prefix_loader.finished, 1)
        assert done.pages == n_pages and done.error is None
        want = synthetic_kv(b.kv_pool, a["rid"], torch.arange(n_pages * PS))
        got = b.kv_pool.read(done.device_indices)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        b.allocator.free(done.device_indices)
        assert b.allocator.available_size() == free0 and b.host_pool.available_size() == host0
        assert b.storage.stats().corrupt == 0
    finally:
        b.close()
