"""Bounded shutdown: what a ``close(timeout=...)`` left behind.

A copy on a worker thread or a CUDA stream cannot be cancelled. ``close`` therefore waits at most
its timeout (default ``DEFAULT_CLOSE_TIMEOUT_S``) and then *abandons* what is still running,
saying exactly what stays quarantined and why, instead of waiting forever.
"""

from __future__ import annotations

import inspect

import msgspec

#: Seconds ``HostOffloader.close`` / ``TransferStack.close`` wait by default for in-flight work.
DEFAULT_CLOSE_TIMEOUT_S = 10.0


class CloseReport(msgspec.Struct):
    """The outcome of a bounded ``close``.

    Attributes:
        clean: every copy and storage op had finished within the timeout (nothing abandoned).
        timeout: the timeout the close ran under (None: it waited without bound).
        abandoned_writes: ack ids of device -> host copies still queued or running at the
            deadline. Each may still be reported by ``finished_writes`` if its copy ever ends.
        device_slots: device token slots those copies may still read: the caller must keep them
            allocated (quarantined) until the copy is reported, or for the process's lifetime.
            Slot ids held on a device are not read at close (``device_slots_unread`` counts them).
        host_pages: host pages those copies may still write: never returned to the host pool.
        abandoned_storage: op ids of host -> storage ops still queued or running; their host
            pages stay busy (``free_host`` refuses them) until ``finished_storage`` reports them.
        abandoned_pages: names of page writes the storage tier still had running at the deadline
            (``Storage.close``: e.g. a file write stuck in a hung filesystem call); the tier may
            still create those pages if the call ever returns.
        reason: one line saying what was abandoned and why ("" when clean).
        device_slots_unread: how many slot ids of abandoned copies live on a device: not read at
            close (a read would wait for the device) and so not listed in ``device_slots``.
    """

    clean: bool
    timeout: float | None
    abandoned_writes: list[int] = msgspec.field(default_factory=list)
    device_slots: list[int] = msgspec.field(default_factory=list)
    host_pages: list[int] = msgspec.field(default_factory=list)
    abandoned_storage: list[int] = msgspec.field(default_factory=list)
    reason: str = ""
    abandoned_pages: list[str] = msgspec.field(default_factory=list)
    device_slots_unread: int = 0


def check_timeout(timeout: float | None) -> None:
    """Raise ValueError unless ``timeout`` is None or a number >= 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number >= 0 or None, got {timeout!r}")


def close_storage(storage, timeout: float | None) -> list[str]:
    """``storage.close`` within ``timeout`` seconds: passed on when the tier's ``close`` takes a
    ``timeout`` (``Storage.close``); a tier whose ``close`` does not (an older custom tier, or one
    that never waits) is closed as it is.

    Returns:
        The names of the page writes the tier abandoned (``[]`` when none or not reported).
    """
    close = storage.close
    try:
        takes_timeout = "timeout" in inspect.signature(close).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_timeout = False
    abandoned = close(timeout=timeout) if takes_timeout else close()
    return sorted(abandoned) if isinstance(abandoned, (list, tuple, set)) else []
