"""Reading an audit log: streamed line by line with a length bound, each event's fields type-checked.

A log is JSON lines. ``read_lines`` never holds more than one line (at most ``MAX_LINE`` bytes) in
memory, so a huge or endless input (``/dev/zero``) is refused, not loaded. ``field_problem`` says
why an event's fields cannot be replayed (``rid`` a list, ``ack_id`` text or past 64 bits ...) and
``event_time`` why its time cannot be one (not finite, outside ``TIME_RANGE``): the replay reports
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
            ``MAX_LINE`` bytes, its line end not counted (raised when that line is reached; earlier
            lines were yielded). A line of exactly ``MAX_LINE`` bytes is read.
    """
    try:
        f = open(path, "rb")
    except OSError as err:
        raise LogUnreadable(f"cannot read {str(path)!r}: {err.strerror or err}") from None
    with f:
        n = 0
        while True:
            try:
                raw = f.readline(MAX_LINE + 2)  # the line, then its "\n" or "\r\n"
            except OSError as err:
                raise LogUnreadable(f"cannot read {str(path)!r}: {err.strerror or err}") from None
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE and len(raw.rstrip(b"\n").rstrip(b"\r")) > MAX_LINE:
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


INT_RANGE = (-(1 << 63), (1 << 63) - 1)   # what the manager can write: ids, positions and counts fit int64
TIME_RANGE = (0.0, 1e11)   # seconds: ``t`` (monotonic) and ``timestamp`` (Unix epoch, up to the year 5138)


def event_time(ev: dict, line: int) -> tuple[float, str | None]:
    """The event's time in seconds: ``t``, else ``timestamp`` (a number, or ISO 8601 text), else the
    line number; and why the field given cannot be a time (None: it can). A time that is not finite
    or outside ``TIME_RANGE`` (a 400-digit integer, ``Infinity``, ``1e308``) is a problem, never a
    crash; the line number then stands in."""
    for name in ("t", "timestamp"):
        v = ev.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            return float(line), f"field {name!r} is {_kind(v)} {_short(v)}, want seconds"
        if isinstance(v, str):
            if name == "t":
                return float(line), f"field 't' is text {_short(v)}, want seconds"
            try:
                from datetime import datetime

                seconds = datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except (ValueError, OverflowError, OSError):
                return float(line), None  # not a time stamp we read: ordered by line (as before)
        elif isinstance(v, int) and not TIME_RANGE[0] <= v <= TIME_RANGE[1]:
            seconds = None
        else:
            seconds = float(v)
        if seconds is None or not TIME_RANGE[0] <= seconds <= TIME_RANGE[1]:  # False for NaN
            return float(line), (f"field {name!r} is {_short(v)}: not a time (want seconds in "
                                 f"{TIME_RANGE[0]:g}..{TIME_RANGE[1]:g})")
        return seconds, None
    return float(line), None


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
        if type(v) is int and not INT_RANGE[0] <= v <= INT_RANGE[1]:
            return f"field {name!r} is {_short(v)}: out of range (want a 64-bit integer)"
    ranges = ev.get("ranges")
    if isinstance(ranges, list) and not all(
            isinstance(p, list) and len(p) == 2
            and all(type(x) is int and INT_RANGE[0] <= x <= INT_RANGE[1] for x in p)
            for p in ranges):
        return f"field 'ranges' is {_short(ranges)}, want a list of [start, end] 64-bit integer pairs"
    return None


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
