"""``lifecycle/integrations/sglang/audit_trail.py``: every record of the ``lifecycle`` logger becomes
one JSON line (a plain record as its message; values JSON cannot hold, as text), a record that
cannot be written is reported the way ``logging`` reports handler errors and never raises, INFO
and above reach the root logger's handlers by their own levels, and closing gives the logger back
its level and propagation."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from lifecycle.integrations.sglang import audit_trail


@pytest.fixture
def lifecycle_logger():
    logger = logging.getLogger(audit_trail.LOGGER)
    saved = (logger.level, logger.propagate, list(logger.handlers))
    logger.setLevel(logging.WARNING)
    logger.propagate = True
    yield logger
    audit_trail.close_audit_trail()
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _record(logger: logging.Logger, level: int, event: dict) -> logging.LogRecord:
    rec = logger.makeRecord(logger.name, level, __file__, 1, "the message", (), None)
    rec.event_dict = event
    return rec


def test_plain_records_are_their_message_and_values_json_cannot_hold_are_text(tmp_path, lifecycle_logger):
    handler = audit_trail.open_audit_trail(0, 1, {audit_trail.AUDIT_ENV: str(tmp_path)})
    assert (lifecycle_logger.level, lifecycle_logger.propagate) == (logging.DEBUG, False)
    lifecycle_logger.debug("plain %s", "words")                      # a stdlib record: no event_dict
    structured = _record(lifecycle_logger, logging.WARNING, {"event": "x.y", "where": pathlib.Path("/d/ü"), "n": 3})
    lifecycle_logger.handle(structured)
    audit_trail.close_audit_trail()
    first, second = _lines(handler.path)
    assert first["event"] == "plain words" and first["level"] == "debug" and isinstance(first["timestamp"], float)
    assert set(first) == {"event", "level", "timestamp"}
    assert second == {"event": "x.y", "where": "/d/ü", "n": 3, "level": "warning", "timestamp": structured.created}
    assert handler._file.closed
    assert (lifecycle_logger.level, lifecycle_logger.propagate) == (logging.WARNING, True)   # given back


def test_a_record_that_cannot_be_written_is_reported_as_a_logging_error_and_never_raises(
        tmp_path, lifecycle_logger, capsys):
    handler = audit_trail.open_audit_trail(0, 0, {audit_trail.AUDIT_ENV: str(tmp_path)})
    loop: dict = {"event": "loop"}
    loop["self"] = loop                                             # json.dumps: circular reference
    lifecycle_logger.handle(_record(lifecycle_logger, logging.INFO, loop))
    lifecycle_logger.handle(_record(lifecycle_logger, logging.INFO, {"event": "after"}))
    audit_trail.close_audit_trail()
    assert [line["event"] for line in _lines(handler.path)] == ["after"]
    err = capsys.readouterr().err
    assert "--- Logging error ---" in err and "Message: 'the message'" in err


def test_info_and_above_reach_each_root_handler_at_or_above_its_level(tmp_path, lifecycle_logger):
    class Keep(logging.Handler):
        def __init__(self, level):
            super().__init__(level)
            self.seen = []

        def emit(self, record):
            self.seen.append(record.levelname)

    root = logging.getLogger()
    keep = Keep(logging.WARNING)
    root.addHandler(keep)
    try:
        audit_trail.open_audit_trail(0, 0, {audit_trail.AUDIT_ENV: str(tmp_path)})
        for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
            lifecycle_logger.log(level, "e")
    finally:
        root.removeHandler(keep)
    assert keep.seen == ["WARNING", "ERROR"]          # its own level included; DEBUG never forwarded
