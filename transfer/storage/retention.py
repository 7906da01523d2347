"""Retention options in a storage spec: how long pages live, under which prefix, in how many bytes.

``open_storage`` accepts them as query options of the spec, so a one-line spec (a CLI flag, a
config file) can set what the API sets:

| tier | options |
|---|---|
| ``memory?...``, ``file:DIR?...`` | ``capacity_bytes`` (LRU byte bound) |
| ``redis://...``, ``redis+cluster://...`` (and the ``rediss``/``valkey`` spellings) | ``ttl_s`` (page expiry, seconds), ``key_prefix`` (prepended to every key), ``capacity_bytes`` (this client's LRU bound over the pages it wrote) |
| ``mooncake://...`` | none: its capacity is ``global_segment_size`` (a Mooncake option); objects have no expiry |

Here the options are only parsed (a value that is not a number, a name the tier does not have, an
option given twice: ``StorageConfigError``); ranges are the constructors' to check. For
``file:DIR`` the options follow the last ``?`` of the spec when it is followed by ``name=value``
pairs, so a directory whose name contains ``?`` and ``=`` after it cannot be named with a spec.
"""

from __future__ import annotations

import math
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from transfer.errors import StorageConfigError

RETENTION_OPTIONS = ("ttl_s", "key_prefix", "capacity_bytes")
_REDIS = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://",
          "redis+cluster://", "rediss+cluster://", "valkey+cluster://", "valkeys+cluster://")


def _tier(spec: str) -> tuple[str, tuple[str, ...]]:
    """(tier name, the retention options it has)."""
    if spec.startswith(_REDIS):
        return "redis", RETENTION_OPTIONS
    if spec.startswith("mooncake://"):
        return "mooncake", ()
    if spec.startswith("file:") or spec == "memory" or spec.startswith("memory?"):
        return "file" if spec.startswith("file:") else "memory", ("capacity_bytes",)
    return "", ()


def _value(name: str, raw: str, spec: str):
    if name == "key_prefix":
        return raw
    try:
        value = float(raw) if name == "ttl_s" else int(raw)
    except ValueError:
        kind = "a number of seconds" if name == "ttl_s" else "a whole number of bytes"
        raise StorageConfigError(f"storage option {name}={raw!r} is not {kind} (in {spec!r})") from None
    if name == "ttl_s" and not math.isfinite(value):
        raise StorageConfigError(f"storage option ttl_s={raw!r} is not a finite number of seconds (in {spec!r})")
    return value


def split_retention_options(spec: str) -> tuple[str, dict]:
    """``(spec without retention options, {option: value})``; a spec without options is returned
    as it is. Other query options (``db``, Mooncake's settings) stay in the spec.

    Raises:
        StorageConfigError: a retention option the tier does not have, given twice, or whose value
            does not parse.
    """
    if not isinstance(spec, str):
        return spec, {}
    tier, allowed = _tier(spec)
    if tier in ("file", "memory"):
        head, sep, query = spec.rpartition("?")
        if not sep or "=" not in query or (tier == "file" and len(head) <= 5):
            return spec, {}   # no options (a "?" in a directory name without "=" is part of it)
        pairs, kept_head = parse_qsl(query, keep_blank_values=True, strict_parsing=False), head
        if not pairs:
            return spec, {}
    elif tier in ("redis", "mooncake"):
        parts = urlsplit(spec)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
    else:
        return spec, {}
    options, kept = {}, []
    for name, raw in pairs:
        if name not in RETENTION_OPTIONS:
            if tier in ("file", "memory"):
                raise StorageConfigError(f"unknown {tier} storage option {name!r} in {spec!r} "
                                         f"(known: capacity_bytes)")
            kept.append((name, raw))
            continue
        if name not in allowed:
            hint = (" (Mooncake's capacity is global_segment_size, bytes per client segment; its objects "
                    "do not expire: they are evicted when a segment fills)" if tier == "mooncake" else
                    " (only Redis and Redis Cluster have ttl_s and key_prefix)")
            raise StorageConfigError(f"{tier} storage has no option {name!r} in {spec!r}{hint}")
        if name in options:
            raise StorageConfigError(f"storage option {name} given twice in {spec!r}")
        options[name] = _value(name, raw, spec)
    if not options:
        return spec, {}
    if tier in ("file", "memory"):
        return kept_head, options
    return urlunsplit(parts._replace(query=urlencode(kept))), options


def merge(name: str, from_spec: dict, argument):
    """The value of option ``name``: the spec's or the argument's; both, differing: an error."""
    if name not in from_spec:
        return argument
    value = from_spec[name]
    if argument is not None and argument != "" and argument != value:
        raise StorageConfigError(f"storage option {name}={value!r} in the spec and {name}={argument!r} "
                                 f"as an argument; give one")
    return value


def with_retention_options(spec: str, **options) -> str:
    """``spec`` with ``options`` (those not None) appended as query options (for command lines
    that take them as flags). Raises StorageConfigError as ``split_retention_options``."""
    given = {k: v for k, v in options.items() if v is not None}
    if not given:
        return spec
    if _tier(spec)[0] in ("file", "memory"):
        sep = "&" if split_retention_options(spec)[1] else "?"
    else:
        sep = "&" if urlsplit(spec).query else "?"
    out = spec + sep + urlencode(given)
    split_retention_options(out)   # the same checks as when it is opened
    return out
