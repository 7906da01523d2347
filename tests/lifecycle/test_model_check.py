"""Exhaustive interleavings for small configurations (see lifecycle_tools/testkit/lifecycle_model.py).

Every ordering of decode/offload, finish, abort, retract, readmit, the landing of each
outstanding copy and the completion of each storage op is explored, deduplicated by abstract
state, with the invariants checked after every event on the real manager. The state graph does
not depend on the page size or the over-allocation, the invariants do: both are varied. One
configuration adds the buggy-scheduler faults (row moved or cleared, bad over-allocation, foreign
manager, re-entrant call, shared offloader, coarser allocator page): each refused, nothing changed.
A larger bound runs as a benchmark: ``bench/model_check.py``.
"""

import logging

import pytest
import structlog

from lifecycle_tools.testkit.lifecycle_model import Config, explore


@pytest.fixture(autouse=True)
def quiet_logs():
    """Managers built here skip debug events (the exploration creates tens of thousands)."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.configure(wrapper_class=old)


@pytest.mark.parametrize(
    "cfg",
    [
        Config(requests=2, chunks=3, page_size=1, spec=0, host_pages=2),
        Config(requests=2, chunks=3, page_size=4, spec=3, host_pages=2),
        Config(requests=2, chunks=1, page_size=4, spec=0, host_pages=3, aborts=True),
        Config(requests=2, chunks=1, page_size=4, spec=3, host_pages=2, faults=True),
    ],
    ids=["2req-3chunks-page1", "2req-3chunks-page4-spec3", "2req-1chunk-page4-aborts", "2req-1chunk-page4-spec3-faults"],
)
def test_every_interleaving_keeps_the_invariants(cfg):
    states, edges, traces = explore(cfg)
    print(f"{cfg}: {states} states, {edges} events, {traces} traces")
    assert traces > states > 100
