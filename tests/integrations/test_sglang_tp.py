"""The integration under tensor parallelism: two ranks (processes, gloo), constructed with SGLang's
TP CPU group, copies landing at different times per rank, a retraction on both ranks while a copy is
in flight (the unbounded, collective wait), MHA pages named per rank and MLA pages written by
rank 0 only (tests/integrations/sglang_tp_worker.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lifecycle_tools.testkit.redis_server import free_port
from tests.integrations.sglang_kit import REQUIRE_ENV
from tests.support.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90 if os.environ.get(REQUIRE_ENV) != "1" else 300  # with sglang: each rank imports it first


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out, store = tmp_path_factory.mktemp("tp-out"), tmp_path_factory.mktemp("tp-store")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("KV_LIFECYCLE_AUDIT_DIR", None)
    run_ranks([[sys.executable, "-m", "tests.integrations.sglang_tp_worker", str(r), str(port), str(store), str(out)]
               for r in (0, 1)], cwd=ROOT, env=env, timeout_s=TIMEOUT_S, hint=" (collectives out of step?)")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], store


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_every_rank_releases_everything_once(ranks, kind):
    results, _ = ranks
    for rank, r in enumerate(results):
        got = r[kind]
        assert got["tp"] == [rank, 2]
        assert (got["released"], got["leaked"], got["tracked"]) == (3, 0, 0)  # "b" twice: retracted, finished
        assert got["pages_back"] and got["rows_back"]
    assert results[0][kind]["pages"] == results[1][kind]["pages"] > 0
    if os.environ.get(REQUIRE_ENV) == "1":  # .ci/sglang-env: the ranks ran over SGLang's own pools
        assert {r[kind]["kit"] for r in results} == {"sglang"}


def test_mha_pages_are_named_per_rank(ranks):
    results, store = ranks
    names = os.listdir(store / "mha")
    for rank in (0, 1):
        mine = [n for n in names if n.endswith(f"_org-M_{rank}_2.bin")]
        assert len(mine) == results[rank]["mha"]["pages"] - results[rank]["mha"]["skipped"]
    assert len(names) == sum(len([n for n in names if n.endswith(f"_{r}_2.bin")]) for r in (0, 1))


def test_mla_pages_are_written_by_rank_0_only(ranks):
    results, store = ranks
    names = os.listdir(store / "mla")
    assert names and all(n.endswith("_org-M.bin") for n in names)
    assert len(names) == results[0]["mla"]["pages"] - results[0]["mla"]["skipped"]
    assert results[1]["mla"]["skipped"] == results[1]["mla"]["pages"]  # rank 1 wrote nothing
