"""Prometheus metrics of a decode node (``prometheus_client``, the ``metrics`` extra).

Nothing is registered anywhere unless asked: ``Metrics(registry)`` creates every metric on the
registry it is given (a fresh ``CollectorRegistry``, or ``prometheus_client.REGISTRY`` inside a
server that exposes that one, as SGLang does with ``--enable-metrics``). Counters and gauges are
set from a ``lifecycle.node_stats.NodeStats`` by ``update`` (counters advance by the difference
since the previous update), so they are the same numbers as ``stats()`` and the simulate report,
and cost nothing between updates. The three histograms are observed as things happen, by hooks
``attach`` installs on the offloader and prefix loader (``copy_seconds``, ``storage_seconds``) and
by ``observe_step`` (the manager's time in one scheduler step). Every metric is listed in
docs/metrics.md.
"""

from __future__ import annotations

import threading
import time

from lifecycle.node_stats import NodeStats, tier_name

BREAKER_STATES = ("closed", "open", "half_open")

_COPY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)


class Metrics:
    """Every kv-lifecycle metric, registered on ``registry``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` (required: nothing global by default).
        namespace: prefix of every metric name (default ``kv_lifecycle``).
        labels: constant labels added to every metric, e.g. ``{"tp_rank": "0"}`` (one process per
            rank writing to one multiprocess directory).
        multiprocess_mode: how ``prometheus_client``'s multiprocess collector merges a gauge
            across processes (used only under ``PROMETHEUS_MULTIPROC_DIR``).
    Raises:
        ImportError: ``prometheus_client`` is not installed (``pip install 'kv-lifecycle[metrics]'``).
        ValueError: a metric of the same name is already registered on ``registry``.
    """

    def __init__(self, registry, *, namespace: str = "kv_lifecycle", labels: dict[str, str] | None = None,
                 multiprocess_mode: str = "mostrecent") -> None:
        if registry is None:
            raise ValueError("Metrics needs a registry (prometheus_client.CollectorRegistry()); "
                             "nothing is registered globally by default")
        from prometheus_client import Counter, Gauge, Histogram

        const = dict(labels or {})
        self._const = const
        names = tuple(const)

        def counter(name, doc, extra=()):
            return Counter(f"{namespace}_{name}", doc, names + tuple(extra), registry=registry)

        def gauge(name, doc, extra=()):
            return Gauge(f"{namespace}_{name}", doc, names + tuple(extra), registry=registry,
                         multiprocess_mode=multiprocess_mode)

        def histogram(name, doc, buckets, extra=()):
            return Histogram(f"{namespace}_{name}", doc, names + tuple(extra), registry=registry, buckets=buckets)

        self.requests = counter("requests", "Requests whose lifecycle ended, by outcome (released: released "
                                "exactly once; leaked: dropped by the scheduler unreleased)", ("outcome",))
        self.transitions = counter("transitions", "State changes, by the trigger that made them", ("event",))
        self.refusals = counter("refusals", "Calls refused with InvalidTransition, by reason ('TRIGGER in "
                                "STATE'); host_short: an offload deferred for want of host pages (the call "
                                "returned False)", ("reason",))
        self.chunks_offloaded = counter("chunks_offloaded", "Chunks handed to the offloader (device -> host copies)")
        self.pages_offloaded = counter("pages_offloaded", "Pages in the chunks handed to the offloader")
        self.bytes_offloaded = counter("bytes_offloaded", "Bytes of the pages handed to the offloader")
        self.copies_failed = counter("copies_failed", "Device -> host copies that failed (raised) or expired "
                                     "(passed write_timeout_s)", ("reason",))
        self.bad_release_rows = counter("bad_release_rows", "Released device rows whose slot ids the device-side "
                                        "check found bad (negative, past the pool, repeated): reported at the next "
                                        "progress check, not refused")
        self.pages_stored = counter("storage_pages", "Pages a storage tier was asked to store, by result (new: "
                                    "written; already_there: found there already, skipped)", ("tier", "result"))
        self.op_failures = counter("storage_op_failures", "Storage operations that failed, by tier and op (set: "
                                   "a write whose pages did not all store; exists: a lookup that failed, timed "
                                   "out or met an open breaker; get: a prefix load that got fewer pages than "
                                   "found)", ("tier", "op"))
        self.pages_refused = counter("storage_pages_refused", "Stored pages refused on read, by reason "
                                     "(corrupt, foreign, wrong_size)", ("tier", "reason"))
        self.pages_foreign_kept = counter("storage_pages_foreign_kept", "Pages another deployment wrote under "
                                          "one of our page names (its seal names another layout, format or "
                                          "page), left alone by a write, an eviction or a delete", ("tier",))
        self.pages_unverified = counter("storage_pages_unverified", "Stored pages read without a seal "
                                        "(served unless strict)", ("tier",))
        self.prefix_lookups = counter("prefix_lookups", "Prefix existence checks")
        self.prefix_pages = counter("prefix_pages", "Prefix pages, by stage (looked_up: asked for; hit: found "
                                    "stored; loaded: loaded into device slots)", ("stage",))
        self.by_state = gauge("requests_live", "Request records in each state now (RELEASED ones stay until the "
                              "request object is dropped)", ("state",))
        self.copies_in_flight = gauge("copies_in_flight", "Device -> host copies issued and not settled")
        self.storage_in_flight = gauge("storage_ops_in_flight", "Storage writes in flight")
        self.host_free_pages = gauge("host_free_pages", "Free pages in the host pool")
        self.quarantined = gauge("quarantined_slots", "Device slots withheld for expired copies")
        self.breaker = gauge("storage_breaker_state", "Circuit breaker state per tier: 1 for the current state "
                             "(closed, open, half_open), 0 for the others", ("tier", "state"))
        self.tier_pages = gauge("storage_pages_held", "Pages this process indexes in a tier (0 for Mooncake: the "
                                "master knows)", ("tier",))
        self.copy_latency = histogram("copy_seconds", "Device -> host copy latency, from write to finished_writes",
                                      _COPY_BUCKETS)
        self.storage_latency = histogram("storage_op_seconds", "Storage operation latency, by tier and op (set: "
                                         "one storage write, on the worker thread; exists: an existence check; "
                                         "get: a prefix read)", _COPY_BUCKETS, ("tier", "op"))
        self.step_time = histogram("manager_step_seconds", "Manager time in one scheduler step (its calls summed)",
                                   _STEP_BUCKETS)
        self._seen: dict = {}  # (source, metric id, constant labels' values, labels) -> last counter value
        self._source, self._cur = None, const
        self._lock = threading.Lock()

    # -- counters and gauges from the stats -----------------------------------------------------
    def update(self, stats: NodeStats, source: object = None, labels: dict[str, str] | None = None) -> None:
        """Set every counter and gauge from ``stats`` (counters advance by the difference since
        the previous update of the same ``source`` with the same constant labels' values; one that
        went backwards is left where it is).

        Args:
            stats: the node's numbers now.
            source: what ``stats`` counts, when several managers in one process share these
                metrics (their counters add up); default: one source.
            labels: values of the constant labels for this update (default: the constructor's).
        """
        with self._lock:
            self._source, self._cur = source, self._values(labels)
            self._update(stats)

    def _values(self, labels: dict[str, str] | None) -> dict[str, str]:
        if not labels:
            return self._const
        unknown = set(labels) - set(self._const)
        if unknown:
            raise ValueError(f"labels {sorted(unknown)} are not among the constant labels {sorted(self._const)}")
        return {**self._const, **labels}

    def _update(self, s: NodeStats) -> None:
        m = s.manager
        self._count(self.requests, m.released, outcome="released")
        self._count(self.requests, m.leaked, outcome="leaked")
        for event, n in m.transitions.items():
            self._count(self.transitions, n, event=event)
        for reason, n in s.refusals.items():
            self._count(self.refusals, n, reason=reason)
        self._count(self.refusals, m.host_short, reason="host_short")
        self._count(self.chunks_offloaded, m.chunks_enqueued)
        self._count(self.pages_offloaded, m.pages_enqueued)
        self._count(self.bytes_offloaded, m.pages_enqueued * s.page_nbytes)
        self._count(self.copies_failed, m.copy_failures, reason="failed")
        self._count(self.copies_failed, m.copies_expired, reason="expired")
        self._count(self.bad_release_rows, m.bad_release_rows)
        for state, n in m.by_state.items():
            self._set(self.by_state, n, state=state)
        self._set(self.copies_in_flight, m.inflight_writes)
        self._set(self.storage_in_flight, m.inflight_storage)
        self._set(self.quarantined, m.quarantined_slots)
        if s.offloader is not None:
            self._set(self.host_free_pages, s.offloader.host_free_pages)
        tier0 = s.tiers[0].tier if s.tiers else "none"
        for t in s.tiers:
            st = t.storage
            self._count(self.pages_stored, st.stored, tier=t.tier, result="new")
            self._count(self.pages_stored, st.skipped, tier=t.tier, result="already_there")
            for reason in ("corrupt", "foreign", "wrong_size"):
                self._count(self.pages_refused, getattr(st, reason), tier=t.tier, reason=reason)
            self._count(self.pages_unverified, st.unverified, tier=t.tier)
            self._count(self.pages_foreign_kept, st.foreign_kept, tier=t.tier)
            self._set(self.tier_pages, st.pages, tier=t.tier)
            if t.breaker is not None:
                for state in BREAKER_STATES:
                    self._set(self.breaker, int(t.breaker.state == state), tier=t.tier, state=state)
        if s.offloader is not None:
            self._count(self.op_failures, s.offloader.storage_failed, tier=tier0, op="set")
        p = s.prefix
        if p is not None:
            self._count(self.op_failures, p.failed + p.timed_out + p.skipped, tier=tier0, op="exists")
            self._count(self.op_failures, p.loads_short, tier=tier0, op="get")
            self._count(self.prefix_lookups, p.lookups)
            self._count(self.prefix_pages, p.pages_looked_up, stage="looked_up")
            self._count(self.prefix_pages, p.pages_found, stage="hit")
            self._count(self.prefix_pages, p.pages_loaded, stage="loaded")

    def _labels(self, metric, labels: dict, const: dict | None = None):
        const = self._cur if const is None else const
        return metric.labels(**const, **labels) if (const or labels) else metric

    def _count(self, metric, value: int, **labels) -> None:
        # one baseline per source and per label set: the constant labels' values are part of it,
        # so one source updated under tp_rank 0 and then 1 counts each rank from its own zero
        key = (self._source, id(metric), tuple(self._cur.items()), tuple(labels.items()))
        child = self._labels(metric, labels)  # created at 0 even before anything happened
        last = self._seen.get(key, 0)
        if value > last:
            child.inc(value - last)
        if value >= last:
            self._seen[key] = value

    def _set(self, metric, value, **labels) -> None:
        self._labels(metric, labels).set(value)

    # -- histograms, as things happen ------------------------------------------------------------
    def observe_step(self, seconds: float, labels: dict[str, str] | None = None) -> None:
        """The manager's time in one scheduler step (its calls, summed)."""
        self._labels(self.step_time, {}, self._values(labels)).observe(seconds)

    def observer(self, tier: str, labels: dict[str, str] | None = None) -> "_Observer":
        """The hook object for an offloader / prefix loader over ``tier`` (``copy_seconds``,
        ``storage_seconds``), with the constant labels' values ``labels``."""
        return _Observer(self, tier, self._values(labels))

    def attach(self, stack) -> None:
        """Install the latency hooks on a ``transfer.build_stack`` stack's offloader and prefix
        loader (``observer`` attributes, None by default)."""
        obs = self.observer(tier_name(stack.storage))
        stack.offloader.observer = obs
        stack.prefix_loader.observer = obs


class _Observer:
    """Latency hooks bound to one tier (called from scheduler and worker threads)."""

    def __init__(self, metrics: Metrics, tier: str, const: dict[str, str]) -> None:
        self._copy = metrics._labels(metrics.copy_latency, {}, const)
        self._ops = {op: metrics._labels(metrics.storage_latency, {"tier": tier, "op": op}, const)
                     for op in ("set", "exists", "get")}

    def copy_seconds(self, seconds: float) -> None:
        self._copy.observe(seconds)

    def storage_seconds(self, op: str, seconds: float) -> None:
        self._ops[op].observe(seconds)


class Updater:
    """Calls ``metrics.update(take())`` at most every ``interval_s`` seconds (``tick``), and always
    on ``flush``: for a scheduler loop that should not take the stats every iteration. ``source``
    and ``labels`` go to every ``Metrics.update`` (several managers sharing one ``Metrics``)."""

    def __init__(self, metrics: Metrics, take, interval_s: float = 0.25, clock=time.monotonic, *,
                 source: object = None, labels: dict[str, str] | None = None) -> None:
        self.metrics, self.take, self.interval_s, self._clock = metrics, take, interval_s, clock
        self._source, self._labels = source, labels
        self._next = float("-inf")

    def tick(self) -> None:
        now = self._clock()
        if now >= self._next:
            self._next = now + self.interval_s
            self.flush()

    def flush(self) -> None:
        self.metrics.update(self.take(), source=self._source, labels=self._labels)


_process_lock = threading.Lock()
_process_metrics: Metrics | None = None


def process_metrics(label_names: tuple[str, ...]) -> Metrics:
    """The process's one ``Metrics`` on ``prometheus_client``'s default registry (made on first
    use: the registry takes each metric name once per process), with constant labels
    ``label_names`` whose values each ``update`` gives: what an engine integration serves on the
    engine's own ``/metrics`` (SGLang's ``--enable-metrics``, vLLM's).

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        ValueError: this process's metrics were made with other label names.
    """
    global _process_metrics
    with _process_lock:
        if _process_metrics is None:
            import prometheus_client

            _process_metrics = Metrics(prometheus_client.REGISTRY, labels=dict.fromkeys(label_names, ""))
        elif tuple(_process_metrics._const) != tuple(label_names):
            raise ValueError(f"this process's kv_lifecycle metrics have the labels {tuple(_process_metrics._const)}, "
                             f"not {tuple(label_names)}")
        return _process_metrics
