"""Our metrics on SGLang's own ``/metrics`` when the server runs with ``--enable-metrics``.

SGLang's schedulers register their metrics on ``prometheus_client``'s default registry in
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the server before it spawns them) and its
HTTP server serves what ``MultiProcessCollector`` reads from that directory. ``hook`` does the same
for the ``kv_lifecycle_*`` metrics (``lifecycle.metrics``), labelled ``tp_rank`` / ``pp_rank``:
created once per scheduler process, refreshed from the manager's ``NodeStats`` at most every
``UPDATE_S`` from ``check_offload_progress`` (SGLang's once-per-iteration call) and at
``release_host_resources``. Without ``--enable-metrics`` nothing is imported or wrapped.
"""

from __future__ import annotations

import time

from lifecycle.metrics import Updater, process_metrics

UPDATE_S = 1.0


def enabled(context) -> bool:
    """Whether SGLang's runtime context has ``--enable-metrics`` on (``get_observability()``)."""
    get = getattr(context, "get_observability", None)
    return bool(callable(get) and getattr(get(), "enable_metrics", False) is True)


class MetricsHook:
    """The metrics of one ``DecodeKVCacheOffloadManager``: its step time (every manager call
    between two ``check_offload_progress`` calls, summed) and its stats, throttled."""

    def __init__(self, wrapper, tp_rank: int, pp_rank: int) -> None:
        from lifecycle.node_stats import collect, tier_name

        self.metrics = m = process_metrics(("tp_rank", "pp_rank"))
        self.labels = {"tp_rank": str(tp_rank), "pp_rank": str(pp_rank)}
        take = lambda: collect(wrapper.manager, offloader=wrapper.offloader, storage=wrapper.storage)  # noqa: E731
        self._updater = Updater(m, take, UPDATE_S, source=self, labels=self.labels)
        wrapper.offloader.observer = m.observer(tier_name(wrapper.storage), self.labels)
        self._step = m.step_time.labels(**self.labels)
        self._spent = 0.0

    def timed(self, fn, ends_step: bool = False):
        """``fn`` with its time added to the current step (``ends_step``: it closes the step)."""
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spent += time.perf_counter() - t
                if ends_step:
                    self._step.observe(self._spent)
                    self._spent = 0.0
                    self.tick()
        return call

    def tick(self, force: bool = False) -> None:
        """Refresh the counters and gauges from the manager's stats (at most every ``UPDATE_S``;
        ``force``: now)."""
        if force:
            self._updater.flush()
        else:
            self._updater.tick()


def hook(wrapper, context, tp_rank: int, pp_rank: int):
    """Hook ``wrapper``'s metrics when ``context`` has metrics enabled; None (nothing done) otherwise.

    Raises:
        ImportError: metrics enabled but ``prometheus_client`` missing (SGLang requires it).
    """
    if not enabled(context):
        return None
    h = MetricsHook(wrapper, tp_rank, pp_rank)
    wrapper.offload_kv_cache = h.timed(wrapper.offload_kv_cache)
    wrapper.finalize_release_on_finish = h.timed(wrapper.finalize_release_on_finish)
    wrapper.check_offload_progress = h.timed(wrapper.check_offload_progress, ends_step=True)
    return h
