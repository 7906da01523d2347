"""A run's telemetry: Prometheus metrics on ``--metrics-port`` (or pushed with ``--metrics-push``)
and KV events on ``--kv-events``.

``Telemetry.start`` binds what the flags ask for (events publisher first, then the HTTP server),
so a port in use is one ``ConfigProblem`` before the workload starts, with nothing left bound.
During the run ``on_step`` observes the manager's time per step and refreshes the counters from
``lifecycle.node_stats`` at most every ``UPDATE_S``, and ``on_wait`` refreshes them (throttled
alike) while a pass drains and around its verification; ``finish`` takes the final numbers once
the stack is shut down. Then ``push`` sends them to a Pushgateway, ``linger`` keeps the HTTP
server answering ``--metrics-linger`` seconds after ``finish`` (so a scraper gets the final
values of a batch run), and ``close`` stops everything.
"""

from __future__ import annotations

import time

from lifecycle_tools import interrupt
from lifecycle_tools.simulate.errors import ConfigProblem

UPDATE_S = 0.1   # the counters lag the run by at most this much (plus one step)
REPLAY_LINGER_S = 1.0   # replays still answered this long after the last batch (with --kv-events-replay)
PUSH_JOB = "kv_lifecycle_simulate"   # the Pushgateway job the final values are pushed under
PUSH_TIMEOUT_S = 10.0   # bound on the push (connect and answer)


class Telemetry:
    """What ``--metrics-port`` / ``--kv-events`` started for one run (each part None when off)."""

    def __init__(self) -> None:
        self.registry = self.metrics = self.updater = self.publisher = None
        self.server = self.url = None
        self._stats = None
        self.push_url, self.linger_s = None, 0.0
        self.final_at = None   # time.monotonic() of the final update (``finish``)
        self._events_closed = False

    @classmethod
    def start(cls, cfg, stack, mgr, update_s: float = UPDATE_S) -> "Telemetry":
        """Bind the publisher and the metrics server ``cfg`` asks for and hook them to the stack;
        the counters are refreshed at most every ``update_s`` seconds (0: at every step).

        Raises:
            ConfigProblem: an endpoint or port cannot be bound, or the extra it needs is missing.
        """
        t = cls()
        try:
            if cfg.kv_events is not None:
                t._start_events(cfg, stack)
            if cfg.metrics_port is not None or cfg.metrics_push is not None:
                t._start_metrics(cfg, stack, mgr, update_s)
        except BaseException:
            t.close()
            raise
        return t

    def _start_events(self, cfg, stack) -> None:
        from transfer.kv_events.publisher import KVEventPublisher, KVEventsError
        from transfer.stack import attach_events

        try:
            self.publisher = KVEventPublisher(cfg.kv_events, replay_endpoint=cfg.kv_events_replay,
                                              replay_linger_s=REPLAY_LINGER_S)
        except KVEventsError as err:
            raise ConfigProblem(f"--kv-events: {err}") from None
        attach_events(stack, self.publisher)

    def _start_metrics(self, cfg, stack, mgr, update_s: float) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as err:
            flag = "--metrics-port" if cfg.metrics_port is not None else "--metrics-push"
            raise ConfigProblem(f"{flag} needs prometheus_client (pip install 'kv-lifecycle[metrics]'): "
                                f"{err}") from None
        from lifecycle.metrics import Metrics, Updater
        from lifecycle.node_stats import from_stack

        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.metrics.attach(stack)
        self._stats = lambda: from_stack(mgr, stack)
        self.updater = Updater(self.metrics, self._stats, update_s)
        self.updater.flush()
        self.push_url, self.linger_s = cfg.metrics_push, cfg.metrics_linger
        if cfg.metrics_port is None:
            return
        try:
            self.server, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=self.registry)
        except OSError as err:
            raise ConfigProblem(f"--metrics-port {cfg.metrics_port} on {cfg.metrics_host}: "
                                f"{err.strerror or err}") from None
        self.url = f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics"

    def on_step(self, seconds: float) -> None:
        """After each scheduler step: observe the manager's time, refresh the counters (throttled)."""
        if self.metrics is not None:
            self.metrics.observe_step(seconds)
            self.updater.tick()

    def on_wait(self) -> None:
        """While the scheduler waits (a pass's drain, around its verification): refresh the
        counters (throttled as ``on_step``)."""
        if self.metrics is not None:
            self.updater.tick()

    def finish(self, stats) -> None:
        """The final numbers (``NodeStats``), taken once the stack was shut down: the report's."""
        if self.metrics is not None:
            self.metrics.update(stats)
            self.final_at = time.monotonic()

    def push(self) -> str | None:
        """With ``--metrics-push``: PUT the registry (the final numbers, after ``finish``) to the
        Pushgateway under job ``PUSH_JOB``. Returns None when it was accepted (or nothing was to
        be pushed), else one line saying why not."""
        if self.push_url is None or self.metrics is None:
            return None
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(self.push_url, job=PUSH_JOB, registry=self.registry, timeout=PUSH_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - any failure of the push is one line, never a traceback
            from urllib.error import HTTPError, URLError

            reason = err.reason if isinstance(err, URLError) and not isinstance(err, HTTPError) else err
            text = " ".join(str(reason).split()) or type(err).__name__
            return f"--metrics-push {self.push_url}: the final metrics were not pushed: {text}"
        return None

    def linger(self) -> None:
        """With ``--metrics-linger S``: keep serving ``/metrics`` until S seconds after the final
        update (returns at once without it; Ctrl-C ends the wait)."""
        if self.server is None or not self.linger_s or self.final_at is None:
            return
        end = self.final_at + self.linger_s
        while (left := end - time.monotonic()) > 0:
            interrupt.check()
            time.sleep(min(left, 0.05))

    def events_stats(self) -> dict | None:
        """What the publisher sent (None without ``--kv-events``); after ``close``: everything."""
        if self.publisher is None:
            return None
        import msgspec

        return msgspec.to_builtins(self.publisher.stats())

    def close_events(self) -> None:
        """Send the last events, close the sockets (``close`` does it too)."""
        if self.publisher is not None and not self._events_closed:
            self._events_closed = True
            self.publisher.close()

    def close(self) -> None:
        """Close the events publisher (``close_events``); stop the HTTP server."""
        self.close_events()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
