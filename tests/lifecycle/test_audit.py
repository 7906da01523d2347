"""The audit trail: one structured event per transition, plus chunk, storage and release events."""

from structlog.testing import capture_logs

from hashing import page_hashes
from lifecycle import audit
from tests.conftest import Node
from lifecycle_tools.testkit.doubles import Req


def trail(logs, *keys):
    return [tuple(e.get(k) for k in keys) for e in logs]


def test_whole_lifecycle_audit_trail():
    node = Node(page_size=4)
    with capture_logs() as logs:
        req = Req("a", range(4), row=2)
        for t in range(4):
            req.decode(100 + t)
            node.mgr.offload_kv_cache(req)
        req.finish()
        node.mgr.offload_kv_cache(req)
        node.mgr.finalize_release_on_finish(req)
        node.land_all()
        node.store_all()
    chain = page_hashes([0, 1, 2, 3, 9000, 100, 101, 102], 4)
    assert trail(logs, "event", "rid", "trigger", "src", "dst") == [
        (audit.TRANSITION, "a", "offload", "PREFILLED", "OFFLOADING"),
        (audit.CHUNK_ENQUEUED, "a", None, None, None),
        (audit.TRANSITION, "a", "enqueued", "OFFLOADING", "INFLIGHT"),
        (audit.TRANSITION, "a", "finish", "INFLIGHT", "FINISHED"),
        (audit.CHUNK_LANDED, "a", None, None, None),
        (audit.RELEASED, "a", None, None, None),   # a transition's work is logged before it
        (audit.TRANSITION, "a", "release", "FINISHED", "RELEASED"),
        (audit.STORED, "a", None, None, None),
    ]
    enq = logs[1]
    assert (enq["ack_id"], enq["start"], enq["end"], enq["pages"], enq["row"]) == (1, 4, 8, 1, 2)
    assert (enq["first_hash"], enq["last_hash"]) == (chain[1], chain[1])
    landed = logs[4]
    assert landed["ack_id"] == 1 and landed["op_id"] == 1 and landed["latency_s"] >= 0
    released = logs[5]
    assert released["ranges"] == [(0, 8)] and released["slots"] == 8 and released["log_level"] == "debug"  # per request: DEBUG (issue 21)
    stored = logs[7]
    assert (stored["op_id"], stored["ack_id"], stored["pages"], stored["last_hash"]) == (1, 1, 1, chain[1])


def test_host_short_and_refusals_are_logged():
    node = Node(page_size=4, host_pages=0)
    with capture_logs() as logs:
        req = Req("b", range(4), row=0)
        for t in range(4):
            req.decode(t)
            node.mgr.offload_kv_cache(req)
        try:
            node.mgr._release_finished_req(req)
        except Exception:
            pass
    events = trail(logs, "event", "trigger", "src", "dst")
    assert events[:3] == [
        (audit.TRANSITION, "offload", "PREFILLED", "OFFLOADING"),
        (audit.TRANSITION, "host_short", "OFFLOADING", "PREFILLED"),
        (audit.HOST_SHORT, None, None, None),
    ]
    assert events[-1] == (audit.REFUSED, "release", None, None)
    assert logs[-1]["state"] == "PREFILLED" and "neither finished" in logs[-1]["reason"]


def test_library_never_configures_structlog():
    import pathlib

    for path in pathlib.Path(__file__).parents[2].joinpath("lifecycle").glob("*.py"):
        if path.name != "cli.py":
            assert "structlog.configure" not in path.read_text(), path
