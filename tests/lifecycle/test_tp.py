"""Tensor-parallel agreement: two ranks (processes, gloo on 127.0.0.1) whose copies land at
different times agree, at every ``check_offload_progress``, on which completions to act on.

Each rank runs tests/support/tp_worker.py: the same replicated scheduler, its own manager
(``tp_group=...``) and an in-memory offloader whose acks land on a per-rank schedule. The ranks
record, after every progress check, what they have seen land and what the manager acted on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lifecycle_tools.testkit.redis_server import free_port
from tests.support.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run_ranks([[sys.executable, "-m", "tests.support.tp_worker", str(r), str(port), str(out)] for r in (0, 1)],
              cwd=ROOT, env=env, timeout_s=TIMEOUT_S)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_act_only_on_completions_every_rank_has_seen(ranks):
    r0, r1 = (r["lag"] for r in ranks)
    assert len(r0["steps"]) == len(r1["steps"])
    differed = False
    for a, b in zip(r0["steps"], r1["steps"]):
        both_landed = set(a["landed"]) & set(b["landed"])
        assert a["acted"] == b["acted"], f"step {a['step']}: ranks acted on different completions"
        assert set(a["acted"]) <= both_landed, f"step {a['step']}: acted on a copy one rank has not seen land"
        assert a["chunks_landed"] == b["chunks_landed"] <= min(len(a["landed"]), len(b["landed"]))
        assert a["storage_finished"] == b["storage_finished"] <= min(a["stored"], b["stored"])
        assert a["states"] == b["states"] and a["released"] == b["released"]
        differed |= len(a["landed"]) != len(b["landed"])
    assert differed, "the schedule never made the ranks see different completions"
    last0, last1 = r0["steps"][-1], r1["steps"][-1]
    assert set(last0["states"].values()) == {"RELEASED"} and last0["released"] == 3
    assert last0["chunks_landed"] == len(last0["landed"]) == len(last1["landed"]) > 5
    assert r0["freed_pages"] == r1["freed_pages"] and r0["freed_rows"] == r1["freed_rows"] == [1, 2, 3]
    assert r0["leaked"] == r1["leaked"] == 0 and r0["idle"] and r1["idle"]


def test_out_of_order_landing_keeps_ranks_in_step(ranks):
    """Acks land out of order, differently per rank (the Offloader protocol allows it; a 2-thread
    CpuCopyEngine does it): ranks still act only on acks landed on both, in the same order. This
    needs the manager to agree on the landed prefix in issue order; agreeing on a count of an
    arrival-ordered deque let rank 0 act on ack 1 and rank 1 on ack 2 at the same step."""
    r0, r1 = (r["reorder"] for r in ranks)
    for a, b in zip(r0["steps"], r1["steps"]):
        both_landed = set(a["landed"]) & set(b["landed"])
        assert set(a["acted"]) <= both_landed and set(b["acted"]) <= both_landed, (
            f"step {a['step']}: rank 0 acted on {a['acted']}, rank 1 on {b['acted']}, "
            f"but only {sorted(both_landed)} have landed on both")
        assert a["acted"] == b["acted"] and a["states"] == b["states"]


def test_out_of_order_landing_stays_safe_per_rank(ranks):
    """Even with out-of-order landing: each rank acts only on its own landed
    copies, counts stay equal across ranks, and both end with everything released once."""
    for r in ranks:
        for s in r["reorder"]["steps"]:
            assert set(s["acted"]) <= set(s["landed"])
    r0, r1 = (r["reorder"] for r in ranks)
    for a, b in zip(r0["steps"], r1["steps"]):
        assert a["chunks_landed"] == b["chunks_landed"] <= min(len(a["landed"]), len(b["landed"]))
    assert r0["steps"][-1]["states"] == r1["steps"][-1]["states"]
    assert set(r0["steps"][-1]["states"].values()) == {"RELEASED"}
    assert r0["freed_pages"] == r1["freed_pages"] and r0["leaked"] == r1["leaked"] == 0
