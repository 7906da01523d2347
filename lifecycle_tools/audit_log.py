"""Reading an audit log: streamed line by line with a length bound, each event's fields type-checked.

A log is JSON lines. ``read_lines`` never holds more than one line (at most ``MAX_LINE`` bytes) in
memory, so a huge or endless input (``/dev/zero``) is refused, not loaded. ``field_problem`` says
why an event's fields cannot be replayed (``rid`` a list, ``ack_id`` text ...): the replay reports
that as a violation on the event's line instead of failing on it.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_LINE = 1 << 20   # bytes; the manager's events are a few hundred


class LogUnreadable(Exception):
    """The file is not a readable text log (missing, a directory, binary, a line over ``MAX_LINE``)."""


def read_lines(path) -> Iterator[str]:
    """The lines of the log at ``path``, decoded.

    Raises:
        LogUnreadable: it cannot be opened or read, is not UTF-8 text, or has a line longer than
            ``MAX_LINE`` bytes (raised when that line is reached; earlier lines were yielded).
    """
    try:
        f = open(path, "rb")
    except OSError as err:
        raise LogUnreadable(f"cannot read {str(path)!r}: {err.strerror or err}") from None
    with f:
        n = 0
        while True:
            try:
                raw = f.readline(MAX_LINE + 1)
            except OSError as err:
                raise LogUnreadable(f"cannot read {str(path)!r}: {err.strerror or err}") from None
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE:
                raise LogUnreadable(f"{str(path)!r} line {n} is longer than {MAX_LINE} bytes: not an audit log")
            if b"\0" in raw:
                raise LogUnreadable(f"{str(path)!r} line {n} holds NUL bytes: not a text file")
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                raise LogUnreadable(f"{str(path)!r} line {n} is not UTF-8 text") from None


_INT, _NUM, _STR = "an integer", "a number", "text"
_ID = "text or an integer"
FIELDS = {   # field -> (types allowed, description); None is allowed where noted in NULLABLE
    "rid": ((str, int), _ID), "gen": ((int,), _INT), "row": ((int,), _INT), "trigger": ((str,), _STR),
    "src": ((str,), _STR), "dst": ((str,), _STR), "ack_id": ((int,), _INT), "start": ((int,), _INT),
    "end": ((int,), _INT), "op_id": ((int,), _INT), "pages": ((int,), _INT), "committed": ((int,), _INT),
    "slots": ((int,), _INT), "state": ((str,), _STR), "reason": ((str,), _STR),
    "ranges": ((list,), "a list of [start, end] pairs"),
}
NULLABLE = {"gen", "row", "op_id", "committed", "pages", "rid", "slots"}


def _kind(value) -> str:
    return "null" if value is None else "true/false" if isinstance(value, bool) else type(value).__name__


def field_problem(ev: dict) -> str | None:
    """Why ``ev``'s known fields have types the replay cannot use (None: they are fine)."""
    for name, (types, want) in FIELDS.items():
        if name not in ev:
            continue
        v = ev[name]
        if v is None and name in NULLABLE:
            continue
        if isinstance(v, bool) or not isinstance(v, types):
            return f"field {name!r} is {_kind(v)} {_short(v)}, want {want}"
    ranges = ev.get("ranges")
    if isinstance(ranges, list) and not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
            for p in ranges):
        return f"field 'ranges' is {_short(ranges)}, want a list of [start, end] integer pairs"
    return None


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
