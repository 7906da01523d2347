"""``lifecycle.metrics``: registered only where asked, counters equal to ``NodeStats``, scraped over
real HTTP."""

from __future__ import annotations

import urllib.request

import prometheus_client
import pytest
import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.metrics import Metrics, Updater
from lifecycle.node_stats import from_stack
from tests.support.decode_driver import PS, Scheduler
from transfer import build_stack


def scrape(url: str) -> dict:
    """``{(name, sorted label items): value}`` of every sample served at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _stack(storage="memory"):
    return build_stack(2, 2, 8, torch.float32, PS, 256, 64, 8, 64, storage=storage)


def test_nothing_is_registered_globally():
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    Metrics(CollectorRegistry())
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before
    with pytest.raises(ValueError, match="registry"):
        Metrics(None)


def test_twice_on_one_registry_is_refused():
    reg = CollectorRegistry()
    Metrics(reg)
    with pytest.raises(ValueError):
        Metrics(reg)
    Metrics(reg, namespace="other")   # another namespace is fine


def test_served_counters_equal_the_stats_during_and_after_a_run(tmp_path):
    stack = _stack(f"file:{tmp_path}")
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": "0"})
    metrics.attach(stack)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    sched = Scheduler(stack)
    try:
        reqs = [sched.admit(r, list(range(40 * r, 40 * r + 6)), 3) for r in range(3)]
        for t in range(6):
            sched.step(700 + t)
            metrics.observe_step(1e-4)
        metrics.update(from_stack(sched.mgr, stack))
        mid = scrape(url)                                     # mid-run: requests live, pages offloaded
        s = from_stack(sched.mgr, stack).manager
        assert mid[("kv_lifecycle_requests_live", (("state", "PREFILLED"), ("tp_rank", "0")))] + \
            mid[("kv_lifecycle_requests_live", (("state", "INFLIGHT"), ("tp_rank", "0")))] == 3
        assert mid[("kv_lifecycle_pages_offloaded_total", (("tp_rank", "0"),))] == s.pages_enqueued > 0
        for req in list(sched.running):
            sched.finish(req)
        sched.settle()
        final = from_stack(sched.mgr, stack)
        metrics.update(final)
        got = scrape(url)
        m, t, o = final.manager, final.tiers[0].storage, final.offloader
        lab = (("tp_rank", "0"),)
        assert got[("kv_lifecycle_requests_total", (("outcome", "released"),) + lab)] == m.released == 3
        assert got[("kv_lifecycle_requests_total", (("outcome", "leaked"),) + lab)] == m.leaked == 0
        assert got[("kv_lifecycle_chunks_offloaded_total", lab)] == m.chunks_enqueued
        assert got[("kv_lifecycle_bytes_offloaded_total", lab)] == m.pages_enqueued * final.page_nbytes
        assert got[("kv_lifecycle_transitions_total", (("event", "release"),) + lab)] == m.transitions["release"]
        assert got[("kv_lifecycle_storage_pages_total", (("result", "new"), ("tier", "file")) + lab)] == t.stored
        assert got[("kv_lifecycle_storage_pages_held", (("tier", "file"),) + lab)] == t.pages
        assert got[("kv_lifecycle_host_free_pages", lab)] == o.host_free_pages
        assert got[("kv_lifecycle_copies_in_flight", lab)] == 0
        assert got[("kv_lifecycle_bad_release_rows_total", lab)] == m.bad_release_rows == 0
        assert got[("kv_lifecycle_copy_seconds_count", lab)] == o.writes_landed == m.chunks_landed
        assert got[("kv_lifecycle_storage_op_seconds_count", (("op", "set"), ("tier", "file")) + lab)] == \
            o.storage_ops
        assert got[("kv_lifecycle_manager_step_seconds_count", lab)] == 6
        metrics.update(final)                                  # an update without change adds nothing
        assert scrape(url)[("kv_lifecycle_chunks_offloaded_total", lab)] == m.chunks_enqueued
    finally:
        server.shutdown()
        server.server_close()
        sched.mgr.shutdown()
        stack.close()


def test_prefix_and_breaker_metrics_from_the_stats(tmp_path):
    stack = _stack(f"file:{tmp_path}")
    reg = CollectorRegistry()
    metrics = Metrics(reg)
    metrics.attach(stack)
    sched = Scheduler(stack)
    try:
        req = sched.admit(0, list(range(12)), 3)
        sched.backup_prompt(req)
        assert stack.prefix_loader.lookup(list(range(12))) != []
        metrics.update(from_stack(sched.mgr, stack))
        p = stack.prefix_loader.stats()
        assert reg.get_sample_value("kv_lifecycle_prefix_pages_total", {"stage": "looked_up"}) == \
            p.pages_looked_up == 3
        assert reg.get_sample_value("kv_lifecycle_prefix_pages_total", {"stage": "hit"}) == p.pages_found == 3
        assert reg.get_sample_value("kv_lifecycle_storage_breaker_state", {"tier": "file", "state": "closed"}) == 1
        assert reg.get_sample_value("kv_lifecycle_storage_breaker_state", {"tier": "file", "state": "open"}) == 0
        assert reg.get_sample_value("kv_lifecycle_storage_op_seconds_count", {"tier": "file", "op": "exists"}) == 1
    finally:
        sched.mgr.shutdown()
        stack.close()


def test_bad_release_rows_are_a_counter_set_from_the_stats():
    reg = CollectorRegistry()
    metrics = Metrics(reg)
    stack = _stack()
    sched = Scheduler(stack)
    try:
        stats = from_stack(sched.mgr, stack)
        stats.manager.bad_release_rows = 2
        metrics.update(stats)
        assert reg.get_sample_value("kv_lifecycle_bad_release_rows_total") == 2
    finally:
        sched.mgr.shutdown()
        stack.close()


def test_the_updater_takes_the_stats_at_most_once_per_interval():
    now = [0.0]
    taken = []
    metrics = Metrics(CollectorRegistry())
    stack = _stack()
    sched = Scheduler(stack)
    try:
        def take():
            taken.append(now[0])
            return from_stack(sched.mgr, stack)

        up = Updater(metrics, take, interval_s=1.0, clock=lambda: now[0])
        for t in (0.0, 0.5, 0.99, 1.0, 1.5, 2.2):
            now[0] = t
            up.tick()
        up.flush()
        assert taken == [0.0, 1.0, 2.2, 2.2]
    finally:
        sched.mgr.shutdown()
        stack.close()
