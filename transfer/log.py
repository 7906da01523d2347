"""Quiet-by-default structured logging for the library packages (``transfer``, ``lifecycle``).

A library embedded in a server prints nothing unless asked. ``get_logger(name)`` returns a small
structlog-style logger (``debug``/``info``/``warning``/``error``/``bind``/``is_enabled_for``)
that decides *at every call* where an event goes, so configuring logging at any time — before or
after the objects that log were built — takes effect:

* the application configured structlog (``structlog.is_configured()``; this is what
  ``structlog.testing.capture_logs``, the ``kv-lifecycle --audit`` option and an application
  using structlog do): the event goes through structlog's configuration exactly as
  ``structlog.get_logger(name)`` would — its processors, level filtering and logger factory;
* otherwise: the event goes to the standard ``logging`` logger ``name`` (``lifecycle``,
  ``transfer.host_offloader``, ...), only when that logger is enabled for the level. Unconfigured,
  Python prints only WARNING and above (to stderr); a handler on ``lifecycle`` or ``transfer``
  receives every event it lets through. The record's message renders as ``event key=value ...``
  and the record carries the structured fields as ``record.event_dict``.

Library code never calls ``structlog.configure()``.
"""

from __future__ import annotations

import logging

import structlog

_METHODS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
            logging.ERROR: "error", logging.CRITICAL: "critical"}
# structlog's level-filtering wrapper classes (one per level, created once by structlog) -> level
_FILTERING = {structlog.make_filtering_bound_logger(lvl): lvl for lvl in (logging.NOTSET, *_METHODS)}


# structlog's configuration object (configure() mutates it in place); None if structlog changes it
_CONFIG = getattr(getattr(structlog, "_config", None), "_CONFIG", None)


def _structlog_configured() -> bool:
    return _CONFIG.is_configured if _CONFIG is not None else structlog.is_configured()


def _structlog_enabled(name: str, level: int) -> bool:
    wrapper = _CONFIG.default_wrapper_class if _CONFIG is not None else structlog.get_config()["wrapper_class"]
    floor = _FILTERING.get(wrapper)
    if floor is not None:
        return level >= floor
    enabled = getattr(structlog.get_logger(name).bind(), "is_enabled_for", None)
    return bool(enabled(level)) if callable(enabled) else True


class _Message:
    """A stdlib log message rendered only when a handler formats it."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: dict) -> None:
        self.event, self.fields = event, fields

    def __str__(self) -> str:
        parts = [str(self.event)]
        parts += [f"{k}={v!r}" for k, v in self.fields.items()]
        return " ".join(parts)


class Logger:
    """A logger bound to ``name`` and a context; cheap to bind, never caches configuration.

    Methods ``debug``, ``info``, ``warning``, ``error``, ``critical`` take an event name and
    keyword fields, like structlog's bound loggers.
    """

    __slots__ = ("name", "context", "_std")

    def __init__(self, name: str, context: dict | None = None, _std: logging.Logger | None = None) -> None:
        self.name = name
        self.context = context or {}
        self._std = _std if _std is not None else logging.getLogger(name)

    def bind(self, **fields) -> "Logger":
        """A logger with ``fields`` added to every event's context."""
        return Logger(self.name, {**self.context, **fields}, self._std)

    def is_enabled_for(self, level: int) -> bool:
        """Whether an event at ``level`` would be emitted now (checked at call time, cheaply)."""
        config = _CONFIG
        if config is not None and config.is_configured:
            floor = _FILTERING.get(config.default_wrapper_class)
            return level >= floor if floor is not None else _structlog_enabled(self.name, level)
        if config is None and structlog.is_configured():
            return _structlog_enabled(self.name, level)
        return self._std.isEnabledFor(level)

    def log(self, level: int, event: str, **fields) -> None:
        """Emit ``event`` at ``level`` (a ``logging`` level) with ``fields``."""
        if _structlog_configured():
            if not _structlog_enabled(self.name, level):
                return
            bound = structlog.get_logger(self.name).bind(**self.context)
            getattr(bound, _METHODS.get(level, "info"))(event, **fields)
        elif self._std.isEnabledFor(level):
            merged = {**self.context, **fields}
            self._std.log(level, _Message(event, merged), extra={"event_dict": {"event": event, **merged}})

    def debug(self, event: str, **fields) -> None:
        self.log(logging.DEBUG, event, **fields)

    def info(self, event: str, **fields) -> None:
        self.log(logging.INFO, event, **fields)

    def warning(self, event: str, **fields) -> None:
        self.log(logging.WARNING, event, **fields)

    def error(self, event: str, **fields) -> None:
        self.log(logging.ERROR, event, **fields)

    def critical(self, event: str, **fields) -> None:
        self.log(logging.CRITICAL, event, **fields)


def get_logger(name: str, **context) -> Logger:
    """The library's logger for ``name`` (a module or package name), with optional context."""
    return Logger(name, context)


PER_OP_INTERVAL_S = 10.0  # at most one line per per-operation event per this many seconds (per limiter)


class _Window:
    __slots__ = ("start", "suppressed", "level", "fields")

    def __init__(self, start: float) -> None:
        self.start, self.suppressed, self.level, self.fields = start, 0, logging.WARNING, {}


class RateLimitedLog:
    """Per-operation warnings and errors, at most one line per event per ``interval_s``.

    A failing tier or disk fails every operation; logging each one floods the log (thousands of
    lines a second). Through this limiter the first occurrence of an event is logged at once with
    its fields; later occurrences within ``interval_s`` are only counted. The next line of that
    event (the first occurrence after the interval, or ``flush()``) carries ``suppressed=N``: the
    occurrences not logged since the previous line, with the fields of the last one; a line written
    by ``flush()`` also has ``summary=True`` (it stands for the suppressed occurrences only). So the
    number of occurrences is the number of lines without ``summary`` plus the sum of ``suppressed``.
    Owners call ``flush()`` when the condition ends (a success after failures) and when closing.
    With ``demote=True`` an occurrence not logged at its level is logged at DEBUG instead of being
    dropped (with its fields, through the same logger): an audit trail at DEBUG keeps every event,
    a console at INFO or above sees the bounded lines. Thread-safe; the lock is never held while
    logging.
    """

    def __init__(self, logger: Logger, interval_s: float = PER_OP_INTERVAL_S, clock=None,
                 demote: bool = False) -> None:
        import threading
        import time

        self.log, self.demote = logger, demote
        self.interval_s = float(interval_s)
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def warning(self, event: str, **fields) -> None:
        self._hit(logging.WARNING, event, fields)

    def error(self, event: str, **fields) -> None:
        self._hit(logging.ERROR, event, fields)

    def log_via(self, logger: Logger, level: int, event: str, **fields) -> None:
        """As ``warning``/``error``, through ``logger`` (e.g. one bound to a request's context)."""
        self._hit(level, event, fields, logger)

    def _hit(self, level: int, event: str, fields: dict, logger: Logger | None = None) -> None:
        logger = logger or self.log
        now = self._clock()
        with self._lock:
            w = self._windows.get(event)
            if w is not None and now - w.start < self.interval_s:
                w.suppressed += 1
                w.level, w.fields = level, fields
                suppressed = -1
            else:
                suppressed = w.suppressed if w is not None else 0
                self._windows[event] = _Window(now)
        if suppressed < 0:
            if self.demote:
                logger.log(logging.DEBUG, event, **fields)
            return
        if suppressed:
            fields = {**fields, "suppressed": suppressed}
        logger.log(level, event, **fields)

    def flush(self) -> None:
        """Write one summary line per event with occurrences not yet logged, and start afresh."""
        with self._lock:
            pending = [(e, w) for e, w in self._windows.items() if w.suppressed]
            self._windows.clear()
        for event, w in pending:
            self.log.log(w.level, event, **{**w.fields, "suppressed": w.suppressed, "summary": True})

    def pending(self) -> int:
        """Occurrences counted but not yet logged."""
        with self._lock:
            return sum(w.suppressed for w in self._windows.values())
