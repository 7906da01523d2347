"""The ``kv_lifecycle_*`` metrics (``lifecycle.metrics``) of the vLLM connector, labelled per rank.

With ``kv_connector_extra_config={"metrics": true}`` each process registers one ``Metrics`` on
``prometheus_client``'s default registry (the one vLLM serves on ``/metrics``; under
``PROMETHEUS_MULTIPROC_DIR`` every process writes to that directory), with constant labels
``role`` and ``tp_rank``: the scheduler side (``role="scheduler"``, ``tp_rank="-"``) publishes the
lifecycle's numbers (requests, transitions, refusals, pages offloaded, copies failed or expired,
states); each worker (``role="worker"``, ``tp_rank`` its rank) its host pool, copy and storage
numbers (pages stored per tier, storage failures, host free pages, copy and storage latencies).
Refreshed at most every ``UPDATE_S`` from the connector's per-step calls, and at shutdown.
"""

from __future__ import annotations

from lifecycle.metrics import Updater, process_metrics

UPDATE_S = 1.0


class ConnectorMetrics:
    """One connector's metrics: ``take`` returns its ``NodeStats`` now; ``tick`` publishes them at
    most every ``UPDATE_S`` (``force``: now)."""

    def __init__(self, role: str, tp_rank: str, take, offloader=None, tier: str | None = None) -> None:
        self.metrics = process_metrics(("role", "tp_rank"))
        self.labels = {"role": role, "tp_rank": tp_rank}
        self._updater = Updater(self.metrics, take, UPDATE_S, source=self, labels=self.labels)
        if offloader is not None:
            offloader.observer = self.metrics.observer(tier or "none", self.labels)

    def tick(self, force: bool = False) -> None:
        if force:
            self._updater.flush()
        else:
            self._updater.tick()


def scheduler_metrics(store) -> ConnectorMetrics:
    """The scheduler side's: the manager's stats (no offloader or tier here: the workers have them)."""
    from lifecycle.node_stats import NodeStats

    mgr = store.manager
    return ConnectorMetrics("scheduler", "-", lambda: NodeStats(mgr.stats(), refusals=mgr.refusals()))


def worker_metrics(worker, tp_rank: int) -> ConnectorMetrics:
    """A worker's: its ``HostOffloader`` and storage tier."""
    from lifecycle.node_stats import NodeStats, TierStats, tier_name
    from lifecycle.records import Stats

    off, store = worker.offloader, worker.storage
    empty = Stats(tracked=0, inflight_writes=0, inflight_storage=0, released=0, leaked=0, by_state={},
                  chunks_enqueued=0, pages_enqueued=0, chunks_landed=0, storage_finished=0, host_short=0)

    def take() -> NodeStats:
        b = getattr(store, "breaker", None)
        tiers = [TierStats(tier_name(store), store.stats(), None if b is None else b.stats())]
        return NodeStats(empty, off.stats(), tiers, None, worker.host.page_nbytes)
    return ConnectorMetrics("worker", str(tp_rank), take, off, tier_name(store))


__all__ = ["ConnectorMetrics", "process_metrics", "scheduler_metrics", "worker_metrics"]
