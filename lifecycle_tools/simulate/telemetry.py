"""A run's telemetry: Prometheus metrics on ``--metrics-port`` and KV events on ``--kv-events``.

``Telemetry.start`` binds what the flags ask for (events publisher first, then the HTTP server),
so a port in use is one ``ConfigProblem`` before the workload starts, with nothing left bound.
During the run ``on_step`` observes the manager's time per step and refreshes the counters from
``lifecycle.node_stats`` at most every ``UPDATE_S``; ``finish`` takes the final numbers once the
stack is shut down (the HTTP server keeps answering until ``close``).
"""

from __future__ import annotations

from lifecycle_tools.simulate.errors import ConfigProblem

UPDATE_S = 0.1   # the counters lag the run by at most this much (plus one step)
REPLAY_LINGER_S = 1.0   # replays still answered this long after the end marker (with --kv-events-replay)


class Telemetry:
    """What ``--metrics-port`` / ``--kv-events`` started for one run (each part None when off)."""

    def __init__(self) -> None:
        self.registry = self.metrics = self.updater = self.publisher = None
        self.server = self.url = None
        self._stats = None

    @classmethod
    def start(cls, cfg, stack, mgr) -> "Telemetry":
        """Bind the publisher and the metrics server ``cfg`` asks for and hook them to the stack.

        Raises:
            ConfigProblem: an endpoint or port cannot be bound, or the extra it needs is missing.
        """
        t = cls()
        try:
            if cfg.kv_events is not None:
                t._start_events(cfg, stack)
            if cfg.metrics_port is not None:
                t._start_metrics(cfg, stack, mgr)
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

    def _start_metrics(self, cfg, stack, mgr) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as err:
            raise ConfigProblem(f"--metrics-port needs prometheus_client (pip install 'kv-lifecycle[metrics]'): "
                                f"{err}") from None
        from lifecycle.metrics import Metrics, Updater
        from lifecycle.node_stats import from_stack

        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.metrics.attach(stack)
        self._stats = lambda: from_stack(mgr, stack)
        self.updater = Updater(self.metrics, self._stats, UPDATE_S)
        self.updater.flush()
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

    def finish(self, stats) -> None:
        """The final numbers (``NodeStats``), taken once the stack was shut down: the report's."""
        if self.metrics is not None:
            self.metrics.update(stats)

    def events_stats(self) -> dict | None:
        """What the publisher sent (None without ``--kv-events``); after ``close``: everything."""
        if self.publisher is None:
            return None
        import msgspec

        return msgspec.to_builtins(self.publisher.stats())

    def close(self) -> None:
        """Send the last events and the end marker, close the sockets; stop the HTTP server."""
        if self.publisher is not None:
            self.publisher.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
