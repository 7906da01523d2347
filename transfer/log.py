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
