"""Value kinds of the reference scheduler's options: convert a flag's text (or a Python value) and
check its range, raising ``ConfigProblem`` with a one-line reason. Each returns the clean value."""

from __future__ import annotations

import math
import os

from lifecycle_tools.simulate.dist import parse_dist
from lifecycle_tools.simulate.errors import ConfigProblem

DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
#: Upper bound of every count option; a run of this many requests takes days.
MAX_COUNT = 10_000_000


def _integer(value, flag: str) -> int:
    if isinstance(value, bool):
        raise ConfigProblem(f"{flag} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigProblem(f"{flag} must be an integer, got {value!r}") from None


def _number(value, flag: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigProblem(f"{flag} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ConfigProblem(f"{flag} must be finite, got {value!r}")
    return v


def integer(lo: int, hi: int | None = MAX_COUNT, optional: bool = False):
    """An integer in ``lo .. hi`` (None allowed when ``optional``)."""
    def check(value, flag: str):
        if value is None and optional:
            return None
        v = _integer(value, flag)
        if v < lo or (hi is not None and v > hi):
            what = "a positive integer" if lo == 1 else "a non-negative integer" if lo == 0 else f">= {lo}"
            raise ConfigProblem(f"{flag} must be {what}{f' up to {hi:,}' if hi is not None else ''}, got {v}")
        return v
    check.kind = "N"
    return check


def number(lo: float, hi: float, kind: str, unit: str = "", zero: str = ""):
    """A finite number in ``lo .. hi``; 0 also allowed (meaning ``zero``) when ``zero`` is given."""
    def check(value, flag: str) -> float:
        v = _number(value, flag)
        if not (lo <= v <= hi or (zero and v == 0)):
            also = f"0 ({zero}) or " if zero else ""
            raise ConfigProblem(f"{flag} must be {also}{lo:g}..{hi:g}{unit}, got {v}")
        return v
    check.kind = kind
    return check


fraction = number(0.0, 1.0, "F")
rate = number(1e-6, 1e6, "R", " per step", zero="all at once")
seconds = number(0.001, 3600, "S", " seconds")


def optional(check):
    """``check``, with None (not given) allowed."""
    def opt(value, flag: str):
        return None if value is None else check(value, flag)
    opt.kind = check.kind
    return opt


ttl = optional(number(1, 10 * 365 * 86400, "S", " seconds"))


def dist(value, flag: str) -> str:
    parse_dist(value, flag)
    return str(value)


dist.kind = "DIST"


def dtype(value, flag: str) -> str:
    if str(value).lower() not in DTYPES:
        raise ConfigProblem(f"unknown {flag} {value!r} (choose from {', '.join(sorted(set(DTYPES)))})")
    return str(value)


dtype.kind = "DTYPE"


def verify(value, flag: str) -> str:
    v = str(value).strip().lower()
    if v not in ("all", "none") and not (v.isdigit() and v.isascii()):
        raise ConfigProblem(f"{flag} must be a count, 'all' or 'none', got {value!r}")
    return v


verify.kind = "N|all|none"


def device(value, flag: str) -> str:
    v = str(value)
    if v not in ("cpu", "cuda") and not (v.startswith("cuda:") and v[5:].isdigit()):
        raise ConfigProblem(f"{flag} must be cpu, cuda or cuda:N, got {value!r}")
    return v


device.kind = "DEVICE"


def text(value, flag: str):
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigProblem(f"{flag} needs a non-empty text value, got {value!r}")
    return value


text.kind = "TEXT"


def flag_(value, flag: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigProblem(f"{flag} is on or off, got {value!r}")
    return value


flag_.kind = "BOOL"


def writable_dir(path: str, flag: str) -> None:
    """Raise ConfigProblem unless ``path`` is (or can be made) a writable directory."""
    path = os.path.expanduser(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigProblem(f"{flag} {path!r} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigProblem(f"{flag} {path!r} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigProblem(f"{flag} {path!r} cannot be created (no write access to {parent!r})")


def zmq_endpoint(value, flag: str):
    """A ZMQ endpoint a publisher can bind (``transfer.kv_events.check_endpoint``), or None."""
    if value is None:
        return None
    from transfer.kv_events.publisher import KVEventsError, check_endpoint

    try:
        return check_endpoint(value)
    except KVEventsError as err:
        raise ConfigProblem(f"{flag}: {err}") from None


zmq_endpoint.kind = "ENDPOINT"


def host(value, flag: str) -> str:
    """An address to bind: an IPv4/IPv6 address or a host name (no spaces, no port)."""
    v = text(value, flag)
    if v is None or any(c.isspace() for c in v) or "/" in v:
        raise ConfigProblem(f"{flag} needs an address such as 127.0.0.1 or 0.0.0.0, got {value!r}")
    return v


host.kind = "ADDR"


def push_url(value, flag: str):
    """A Pushgateway's address, ``http(s)://HOST[:PORT][/PATH]`` (no query, fragment or
    credentials), or None."""
    if value is None:
        return None
    from urllib.parse import urlsplit

    v = text(value, flag)
    try:
        u = urlsplit(v)
        port = u.port   # raises ValueError for a port out of range or not a number
    except ValueError as err:
        raise ConfigProblem(f"{flag} {value!r}: {err}") from None
    if (u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or "@" in u.netloc
            or any(c.isspace() for c in v) or port == 0):
        raise ConfigProblem(f"{flag} needs a Pushgateway address such as http://127.0.0.1:9091, got {value!r}")
    return v


push_url.kind = "URL"
