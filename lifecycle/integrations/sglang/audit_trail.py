"""The lifecycle's audit trail inside SGLang, as JSON lines ``kv-lifecycle audit`` replays.

Opt-in with ``KV_LIFECYCLE_AUDIT_DIR=DIR``: each scheduler process that constructs our manager
writes ``DIR/lifecycle-tp{tp_rank}-pp{pp_rank}-{pid}.jsonl``, one JSON object per event of the
``lifecycle`` logger (the manager's ``lifecycle.*`` events at DEBUG and above, and this
integration's ``sglang.*`` events), with ``level`` and ``timestamp`` (epoch seconds). The library
still configures nothing else: with the variable set, the ``lifecycle`` logger is set to DEBUG and
stops propagating, and a forwarding handler passes its INFO-and-above records on to the root
logger's handlers, so SGLang's console shows what it showed before and no DEBUG lines.
Without the variable nothing is changed (events go to the ``lifecycle`` logger as usual).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from lifecycle.integrations.sglang.errors import SGLangConfigError

AUDIT_ENV = "KV_LIFECYCLE_AUDIT_DIR"
LOGGER = "lifecycle"

_lock = threading.Lock()
_saved: list = []  # the lifecycle logger's (level, propagate) before the trail was opened


class JsonLinesHandler(logging.Handler):
    """Writes each record's structured event (``record.event_dict``) as one JSON line, flushed."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "event_dict", None) or {"event": record.getMessage()}
        line = {**event, "level": record.levelname.lower(), "timestamp": record.created}
        try:
            text = json.dumps(line, default=str)
            with self.lock:
                self._file.write(text + "\n")
                self._file.flush()
        except Exception:  # a logging handler never raises into the caller
            self.handleError(record)

    def close(self) -> None:
        with self.lock:
            if not self._file.closed:
                self._file.close()
        super().close()


class _ToRoot(logging.Handler):
    """Hands records at or above its level to the root logger's handlers (propagation, filtered)."""

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        for handler in root.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def open_audit_trail(tp_rank: int, pp_rank: int, environ=None) -> JsonLinesHandler | None:
    """Start this process's audit file when ``KV_LIFECYCLE_AUDIT_DIR`` is set (once per process).

    Returns:
        The handler writing the file (already attached), or None when the variable is unset.
    Raises:
        SGLangConfigError: the directory cannot be created or the file opened.
    """
    directory = (os.environ if environ is None else environ).get(AUDIT_ENV)
    if not directory:
        return None
    logger = logging.getLogger(LOGGER)
    with _lock:
        for handler in logger.handlers:
            if isinstance(handler, JsonLinesHandler):
                return handler
        path = os.path.join(directory, f"lifecycle-tp{tp_rank}-pp{pp_rank}-{os.getpid()}.jsonl")
        try:
            os.makedirs(directory, exist_ok=True)
            handler = JsonLinesHandler(path)
        except OSError as err:
            raise SGLangConfigError(f"{AUDIT_ENV}={directory!r}: cannot write the audit trail: {err}") from err
        _saved[:] = [(logger.level, logger.propagate)]
        logger.addHandler(handler)
        logger.addHandler(_ToRoot(logging.INFO))
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        return handler


def close_audit_trail() -> None:
    """Detach and close this process's audit file; the ``lifecycle`` logger gets back its level and
    propagation."""
    logger = logging.getLogger(LOGGER)
    with _lock:
        ours = [h for h in logger.handlers if isinstance(h, (JsonLinesHandler, _ToRoot))]
        if not ours:
            return
        for handler in ours:
            logger.removeHandler(handler)
            handler.close()
        level, propagate = _saved.pop() if _saved else (logging.NOTSET, True)
        logger.setLevel(level)
        logger.propagate = propagate
