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


# -- docs/metrics.md is the contract; every served sample; labels, modes, buckets, Updater ------------------------
# (the block below checks what ``Metrics`` serves against the tables of docs/metrics.md, "Every metric", and every
# value ``update`` sets against a ``NodeStats`` whose fields are all different numbers)

import re  # noqa: E402
from pathlib import Path  # noqa: E402

from prometheus_client import Gauge, generate_latest  # noqa: E402

from lifecycle.node_stats import NodeStats, TierStats  # noqa: E402
from lifecycle.records import Stats  # noqa: E402
from transfer.host_offloader import OffloaderStats  # noqa: E402
from transfer.prefix import PrefixStats  # noqa: E402
from transfer.storage.base import StorageStats  # noqa: E402
from transfer.storage.breaker import BreakerStats  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
TP0 = (("tp_rank", "0"),)


def _doc_tables() -> list[list[dict[str, str]]]:
    """The markdown tables of docs/metrics.md's "Every metric" section, each a list of {header: cell}."""
    text = DOC.read_text()
    section = text[text.index("## Every metric"):]
    section = section[:section.index("\n## ", 1)]
    tables, rows = [], None
    for line in section.splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if rows is None:
            rows, header = [], cells
            tables.append(rows)
        elif set(line) - set("|-"):
            rows.append(dict(zip(header, cells)))
    return tables


def _documented() -> dict[str, dict]:
    """``{served family name: {type, labels, closed, help}}`` from the metric table: ``labels`` the
    label names, ``closed`` {label: values} where the cell lists every value (backticked names only)."""
    out = {}
    for row in _doc_tables()[0]:
        name = "kv_lifecycle_" + row["metric"].strip("`")
        if row["type"] == "counter":
            assert name.endswith("_total"), name
            name = name[:-len("_total")]
        names_part, _, values_part = row["labels"].partition(":")
        labels = tuple(re.findall(r"`([a-z_]+)`", names_part))
        closed = {}
        if re.fullmatch(r"\s*`[a-z_]+`(,\s*`[a-z_]+`)*\s*", values_part):
            closed[labels[-1]] = set(re.findall(r"`([a-z_]+)`", values_part))
        out[name] = {"type": row["type"], "labels": labels, "closed": closed, "help": row["HELP"].replace("`", "")}
    return out


def _served(reg) -> dict:
    """``{family name: family}`` of what ``reg`` serves, read back from the exposition text."""
    return {fam.name: fam for fam in text_string_to_metric_families(generate_latest(reg).decode())
            if not fam.name.endswith("_created")}    # a counter's and a histogram's creation times


def _numbered(k: int = 1, tiers: bool = True) -> NodeStats:
    """A ``NodeStats`` whose every field the metrics read is a different number (times ``k``)."""
    m = Stats(tracked=1 * k, inflight_writes=2 * k, inflight_storage=3 * k, released=5 * k, leaked=7 * k,
              by_state={"PREFILLED": 11 * k, "INFLIGHT": 13 * k, "RELEASED": 17 * k}, chunks_enqueued=19 * k,
              pages_enqueued=23 * k, chunks_landed=29 * k, storage_finished=31 * k, host_short=37 * k,
              copies_expired=41 * k, copy_failures=43 * k, quarantined_slots=47 * k,
              transitions={"offload": 53 * k, "release": 59 * k}, bad_release_rows=61 * k)
    off = OffloaderStats(storage_failed=67 * k, host_free_pages=71 * k)
    file = TierStats("file", StorageStats(pages=73 * k, stored=79 * k, skipped=83 * k, corrupt=89 * k, foreign=97 * k,
                                          wrong_size=101 * k, unverified=103 * k), BreakerStats(state="open"))
    mem = TierStats("memory", StorageStats(pages=107 * k, stored=109 * k, skipped=113 * k, corrupt=127 * k,
                                           foreign=131 * k, wrong_size=137 * k, unverified=139 * k))
    p = PrefixStats(lookups=149 * k, pages_looked_up=151 * k, pages_found=157 * k, failed=163 * k,
                    timed_out=167 * k, skipped=173 * k, pages_loaded=179 * k, loads_short=181 * k)
    return NodeStats(m, off, [file, mem] if tiers else [], p, page_nbytes=4096,
                     refusals={"finish in RELEASED": 191 * k, "release in INFLIGHT": 193 * k})


def _expected(s: NodeStats, lab=TP0) -> dict:
    """Every counter and gauge sample ``update(s)`` should serve, written out from the source column
    of docs/metrics.md (counters as if ``s`` were the first update)."""
    def key(name, **labels):
        return (name, tuple(sorted(labels.items())) + lab if labels else lab)

    m, o, p = s.manager, s.offloader, s.prefix
    tier0 = s.tiers[0].tier if s.tiers else "none"
    out = {key("kv_lifecycle_requests_total", outcome="released"): m.released,
           key("kv_lifecycle_requests_total", outcome="leaked"): m.leaked,
           key("kv_lifecycle_refusals_total", reason="host_short"): m.host_short,
           key("kv_lifecycle_chunks_offloaded_total"): m.chunks_enqueued,
           key("kv_lifecycle_pages_offloaded_total"): m.pages_enqueued,
           key("kv_lifecycle_bytes_offloaded_total"): m.pages_enqueued * s.page_nbytes,
           key("kv_lifecycle_copies_failed_total", reason="failed"): m.copy_failures,
           key("kv_lifecycle_copies_failed_total", reason="expired"): m.copies_expired,
           key("kv_lifecycle_bad_release_rows_total"): m.bad_release_rows,
           key("kv_lifecycle_copies_in_flight"): m.inflight_writes,
           key("kv_lifecycle_storage_ops_in_flight"): m.inflight_storage,
           key("kv_lifecycle_quarantined_slots"): m.quarantined_slots,
           key("kv_lifecycle_host_free_pages"): o.host_free_pages,
           key("kv_lifecycle_storage_op_failures_total", tier=tier0, op="set"): o.storage_failed,
           key("kv_lifecycle_storage_op_failures_total", tier=tier0, op="exists"): p.failed + p.timed_out + p.skipped,
           key("kv_lifecycle_storage_op_failures_total", tier=tier0, op="get"): p.loads_short,
           key("kv_lifecycle_prefix_lookups_total"): p.lookups,
           key("kv_lifecycle_prefix_pages_total", stage="looked_up"): p.pages_looked_up,
           key("kv_lifecycle_prefix_pages_total", stage="hit"): p.pages_found,
           key("kv_lifecycle_prefix_pages_total", stage="loaded"): p.pages_loaded}
    out.update({key("kv_lifecycle_transitions_total", event=e): n for e, n in m.transitions.items()})
    out.update({key("kv_lifecycle_refusals_total", reason=r): n for r, n in s.refusals.items()})
    out.update({key("kv_lifecycle_requests_live", state=st): n for st, n in m.by_state.items()})
    for t in s.tiers:
        st = t.storage
        out[key("kv_lifecycle_storage_pages_total", tier=t.tier, result="new")] = st.stored
        out[key("kv_lifecycle_storage_pages_total", tier=t.tier, result="already_there")] = st.skipped
        for reason in ("corrupt", "foreign", "wrong_size"):
            out[key("kv_lifecycle_storage_pages_refused_total", tier=t.tier, reason=reason)] = getattr(st, reason)
        out[key("kv_lifecycle_storage_pages_unverified_total", tier=t.tier)] = st.unverified
        out[key("kv_lifecycle_storage_pages_foreign_kept_total", tier=t.tier)] = st.foreign_kept
        out[key("kv_lifecycle_storage_pages_held", tier=t.tier)] = st.pages
        if t.breaker is not None:
            for state in ("closed", "open", "half_open"):
                out[key("kv_lifecycle_storage_breaker_state", tier=t.tier, state=state)] = int(t.breaker.state == state)
    return out


def _counters_and_gauges(reg) -> dict:
    """``{(sample name, sorted labels): value}`` of every served counter and gauge sample (no ``_created``)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in _served(reg).values() if fam.type in ("counter", "gauge")
            for s in fam.samples if not s.name.endswith("_created")}


def test_every_documented_metric_is_served_as_documented_and_nothing_else(tmp_path):
    """docs/metrics.md's table is the operators' promise: each metric served under its name, with its
    type, its HELP word for word and its labels (plus the constant ones), the closed label value sets
    exactly, and no metric the table does not list."""
    doc = _documented()
    assert len(doc) == 25
    stack = _stack(f"file:{tmp_path}")
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": "0"})
    metrics.attach(stack)
    sched = Scheduler(stack)
    try:
        req = sched.admit(0, list(range(12)), 3)
        sched.backup_prompt(req)
        assert stack.prefix_loader.lookup(list(range(12))) != []
        for t in range(6):
            sched.step(700 + t)
            metrics.observe_step(1e-4)
        sched.finish(req)
        sched.settle()
        metrics.update(from_stack(sched.mgr, stack))
        served = _served(reg)
        assert set(served) == set(doc)
        for name, d in doc.items():
            fam = served[name]
            assert (fam.type, fam.documentation) == (d["type"], d["help"]), name
            samples = [s for s in fam.samples if not s.name.endswith("_created")]
            assert samples, f"{name}: nothing served"
            for s in samples:
                assert set(s.labels) - {"le"} == {"tp_rank", *d["labels"]}, name
                assert s.labels["tp_rank"] == "0"
                assert s.labels.get("tier", "file") == "file", name
            for label, values in d["closed"].items():
                assert {s.labels[label] for s in samples} == values, (name, label)
        host_short = [s for s in served["kv_lifecycle_refusals"].samples if s.name.endswith("_total")]
        assert [s.labels["reason"] for s in host_short] == ["host_short"]
    finally:
        sched.mgr.shutdown()
        stack.close()


def test_histogram_buckets_are_the_documented_ones():
    buckets = {}
    for row in _doc_tables()[1]:
        bounds = [float(b) for b in row["bucket upper bounds, seconds (then `+Inf`)"].split(",")] + [float("inf")]
        for name in re.findall(r"`([a-z_]+)`", row["histogram"]):
            buckets["kv_lifecycle_" + name] = bounds
    assert sorted(buckets) == sorted(n for n, d in _documented().items() if d["type"] == "histogram")
    reg = CollectorRegistry()
    metrics = Metrics(reg)
    metrics.observer("file")
    served = _served(reg)
    for name, bounds in buckets.items():
        le = [float(s.labels["le"]) for s in served[name].samples
              if s.name.endswith("_bucket") and s.labels.get("op", "set") == "set"]
        assert le == bounds, name


def test_gauges_merge_across_processes_by_the_given_mode():
    gauges = [m for m in vars(Metrics(CollectorRegistry())).values() if isinstance(m, Gauge)]
    assert len(gauges) == sum(d["type"] == "gauge" for d in _documented().values()) == 7
    assert {g._multiprocess_mode for g in gauges} == {"mostrecent"}
    metrics = Metrics(CollectorRegistry(), multiprocess_mode="livesum")
    assert {g._multiprocess_mode for g in vars(metrics).values() if isinstance(g, Gauge)} == {"livesum"}


def test_every_counter_and_gauge_is_its_stats_field():
    """Each sample equals the field the docs name; with every field a different number, a value
    from the wrong field, a wrong label value or a lost sample shows."""
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": "0"})
    metrics.update(_numbered())
    assert _counters_and_gauges(reg) == _expected(_numbered())
    metrics.update(_numbered(3))                    # counters advance by the difference, gauges are set
    assert _counters_and_gauges(reg) == _expected(_numbered(3))
    metrics.update(_numbered(2))                    # a counter that went backwards stays where it is
    got, lower, higher = _counters_and_gauges(reg), _expected(_numbered(2)), _expected(_numbered(3))
    assert got == {k: higher[k] if k[0].endswith("_total") else lower[k] for k in lower}
    metrics.update(_numbered(4))                    # ... and advances from its highest value
    assert _counters_and_gauges(reg) == _expected(_numbered(4))


def test_without_a_tier_the_op_failures_count_against_tier_none():
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": "0"})
    stats = _numbered(tiers=False)
    metrics.update(stats)
    assert _counters_and_gauges(reg) == _expected(stats)
    assert reg.get_sample_value("kv_lifecycle_storage_op_failures_total",
                                {"tp_rank": "0", "tier": "none", "op": "exists"}) == 163 + 167 + 173


def test_a_node_without_offloader_or_prefix_loader_serves_the_manager_part():
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": "0"})
    full = _numbered()
    metrics.update(NodeStats(full.manager, refusals=full.refusals))
    gone = ("host_free_pages", "storage_pages", "storage_op_failures", "storage_breaker", "prefix")
    want = {k: v for k, v in _expected(full).items() if not any(g in k[0] for g in gone)}
    assert _counters_and_gauges(reg) == {**want, ("kv_lifecycle_bytes_offloaded_total", TP0): 0}  # page_nbytes 0


def test_the_constant_labels_values_per_update_step_and_observer():
    """``update``, ``observe_step`` and ``observer`` each take the constant labels' values they are
    given, and default to the constructor's, not to the previous update's."""
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": "0"})
    metrics.update(_numbered(), labels={"tp_rank": "1"})
    assert reg.get_sample_value("kv_lifecycle_requests_total", {"tp_rank": "1", "outcome": "released"}) == 5
    assert reg.get_sample_value("kv_lifecycle_requests_total", {"tp_rank": "0", "outcome": "released"}) is None
    metrics.observe_step(3e-5, labels={"tp_rank": "2"})
    metrics.observe_step(0.5)
    obs = metrics.observer("file", {"tp_rank": "3"})
    obs.copy_seconds(2e-3)
    for op in ("set", "exists", "get"):
        obs.storage_seconds(op, 0.3)
    metrics.observer("memory").storage_seconds("get", 7.0)

    def count(name, **labels):
        return reg.get_sample_value(f"kv_lifecycle_{name}_count", labels)

    assert [count("manager_step_seconds", tp_rank=r) for r in "0123"] == [1, None, 1, None]
    assert reg.get_sample_value("kv_lifecycle_manager_step_seconds_sum", {"tp_rank": "2"}) == 3e-5
    assert [count("copy_seconds", tp_rank=r) for r in "0123"] == [0, None, None, 1]
    for op in ("set", "exists", "get"):
        assert count("storage_op_seconds", tp_rank="3", tier="file", op=op) == 1
        assert reg.get_sample_value("kv_lifecycle_storage_op_seconds_sum",
                                    {"tp_rank": "3", "tier": "file", "op": op}) == 0.3
    assert count("storage_op_seconds", tp_rank="0", tier="memory", op="get") == 1
    assert count("storage_op_seconds", tp_rank="0", tier="memory", op="set") == 0
    step = {float(s.labels["le"]): s.value for s in _served(reg)["kv_lifecycle_manager_step_seconds"].samples
            if s.name.endswith("_bucket") and s.labels["tp_rank"] == "2"}
    assert step == {le: float(le >= 5e-5) for le in step}


def test_counters_are_tracked_per_label_set():
    """One source updated under ``tp_rank`` 0 and then 1 (an embedder whose rank label changes
    per call): each label set counts from its own zero and advances from its own last value."""
    reg = CollectorRegistry()
    metrics = Metrics(reg, labels={"tp_rank": ""})

    def rank(r):
        return {k: v for k, v in _counters_and_gauges(reg).items() if ("tp_rank", r) in k[1]}

    metrics.update(_numbered(), labels={"tp_rank": "0"})
    metrics.update(_numbered(), labels={"tp_rank": "1"})
    assert reg.get_sample_value("kv_lifecycle_requests_total", {"tp_rank": "1", "outcome": "released"}) == 5
    assert rank("0") == _expected(_numbered(), (("tp_rank", "0"),))
    assert rank("1") == _expected(_numbered(), (("tp_rank", "1"),))
    metrics.update(_numbered(3), labels={"tp_rank": "1"})
    metrics.update(_numbered(2), labels={"tp_rank": "0"})
    assert rank("0") == _expected(_numbered(2), (("tp_rank", "0"),))
    assert rank("1") == _expected(_numbered(3), (("tp_rank", "1"),))
    metrics.update(_numbered(), source="other", labels={"tp_rank": "0"})   # another source adds up
    assert reg.get_sample_value("kv_lifecycle_requests_total", {"tp_rank": "0", "outcome": "released"}) == 15


def test_labels_not_among_the_constant_ones_are_refused():
    metrics = Metrics(CollectorRegistry(), labels={"tp_rank": "0"})
    msg = "labels ['pp_rank'] are not among the constant labels ['tp_rank']"
    with pytest.raises(ValueError) as err:
        metrics.update(_numbered(), labels={"pp_rank": "1"})
    assert str(err.value) == msg
    for call in (lambda: metrics.observe_step(1.0, labels={"pp_rank": "1", "tp_rank": "1"}),
                 lambda: metrics.observer("file", {"pp_rank": "1"})):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == msg


def test_no_registry_is_refused_with_the_fix():
    with pytest.raises(ValueError) as err:
        Metrics(None)
    assert str(err.value) == ("Metrics needs a registry (prometheus_client.CollectorRegistry()); "
                              "nothing is registered globally by default")


def test_the_updater_by_default_takes_the_stats_at_most_every_quarter_second():
    now, taken = [0.0], []
    metrics = Metrics(CollectorRegistry())

    def take():
        taken.append(now[0])
        return _numbered()

    up = Updater(metrics, take, clock=lambda: now[0])
    for t in (-1e9, -1e9 + 0.2, 0.0, 0.2, 0.25, 0.3, 0.5):
        now[0] = t
        up.tick()
    assert taken == [-1e9, 0.0, 0.25, 0.5]


def test_the_process_metrics_are_made_once_and_refused_under_other_label_names(monkeypatch):
    """``process_metrics``: one ``Metrics`` per process on the default registry (an engine
    integration's); asked again, the same one; asked with other constant labels, a ValueError and
    nothing registered again."""
    import prometheus_client

    from lifecycle import metrics as lifecycle_metrics

    reg = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", reg)
    monkeypatch.setattr(lifecycle_metrics, "_process_metrics", None)
    first = lifecycle_metrics.process_metrics(("role", "tp_rank"))
    assert lifecycle_metrics.process_metrics(("role", "tp_rank")) is first
    with pytest.raises(ValueError, match=r"labels \('role', 'tp_rank'\), not \('tp_rank', 'pp_rank'\)"):
        lifecycle_metrics.process_metrics(("tp_rank", "pp_rank"))
    assert lifecycle_metrics.process_metrics(("role", "tp_rank")) is first


def test_the_process_metrics_labels_are_empty_until_an_update_gives_them(monkeypatch):
    """The constant labels start empty: a latency observed before any ``update`` is labelled
    ``""``, never a made-up value."""
    import prometheus_client

    from lifecycle import metrics as lifecycle_metrics

    reg = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", reg)
    monkeypatch.setattr(lifecycle_metrics, "_process_metrics", None)
    lifecycle_metrics.process_metrics(("tp_rank", "pp_rank")).observe_step(0.01)
    labels = [s.labels for m in reg.collect() for s in m.samples if s.name == "kv_lifecycle_manager_step_seconds_count"]
    assert labels == [{"tp_rank": "", "pp_rank": ""}]


def test_the_updater_passes_its_source_and_labels_to_every_update():
    seen = []

    class Recording:
        def update(self, stats, source=None, labels=None):
            seen.append((stats, source, labels))

    now = [0.0]
    up = Updater(Recording(), lambda: "stats", interval_s=1.0, clock=lambda: now[0], source="src",
                 labels={"tp_rank": "3"})
    up.tick()
    up.tick()            # within the interval: nothing
    up.flush()
    assert seen == [("stats", "src", {"tp_rank": "3"})] * 2
