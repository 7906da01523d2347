"""A CPU stand-in for device memory that fails a test when the scheduler thread reads it on the host.

On CUDA, reading a device tensor's values on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.to("cpu")``, ``int()``, ``bool()``, ``.numpy()``, printing it) blocks the calling thread until the
stream has caught up, and so do ops whose output size depends on the values (``torch.unique``,
``nonzero``, boolean-mask indexing). On SGLang's scheduler thread such a sync costs the overlap with
the next forward. ``torch.cuda.set_sync_debug_mode("error")`` catches them, but only on a GPU.

``DeviceResident`` is a ``torch.Tensor`` subclass over ordinary CPU memory that the library treats as
device memory (``transfer.indices.on_host`` is False for it: it declares ``device_resident = True``)
and that raises ``HostSync`` on any such read made *on a thread armed with* ``no_host_sync()``. Every
op on it returns a ``DeviceResident`` again, so the property follows the values from
``req_to_token`` through slicing and casts to wherever they are used. Threads not armed (the copy
workers, which stand in for the device) read freely, and so does code inside ``allowed()`` — the
SGLang doubles' own free paths: SGLang's code is not ours to keep sync-free.

Usage::

    table = as_device_resident(pool.req_to_token)   # SGLang-shaped pools on the "device"
    with no_host_sync():
        mgr.offload_kv_cache(req)                   # HostSync if our code reads a slot id on the host
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

_state = threading.local()


class HostSync(AssertionError):
    """The armed thread read device-resident values on the host (a device -> host sync on CUDA)."""


def _armed() -> bool:
    return getattr(_state, "armed", 0) > 0 and getattr(_state, "allowed", 0) == 0


_T = torch.Tensor
#: reads of values on the host, and ops whose result size depends on the values (a sync on CUDA)
_READS = {
    _T.item, _T.tolist, _T.numpy, _T.cpu, _T.__int__, _T.__bool__, _T.__float__, _T.__index__,
    _T.__format__, _T.__repr__, _T.__str__, _T.__array__, _T.nonzero, _T.unique, _T.masked_select,
    torch.nonzero, torch.unique, torch.masked_select, torch.unique_consecutive, _T.unique_consecutive,
    torch.Tensor.__iter__,
}


def _to_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the CPU (a device -> host copy on CUDA)."""
    for value in list(args[1:]) + list(kwargs.values()):
        if isinstance(value, str) and value.split(":")[0] == "cpu":
            return True
        if isinstance(value, torch.device) and value.type == "cpu":
            return True
        if isinstance(value, torch.Tensor) and not isinstance(value, DeviceResident) and value.device.type == "cpu":
            return True
    return False


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype is torch.bool for i in items)


class DeviceResident(torch.Tensor):
    """CPU memory standing in for device memory (see the module docstring)."""

    device_resident = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _armed():
            name = getattr(func, "__name__", repr(func))
            if func in _READS or (func is _T.to and _to_host(args, kwargs)) or (
                    func is _T.__getitem__ and _bool_index(args)):
                raise HostSync(f"the scheduler thread read device-resident values on the host ({name}): "
                               f"a device -> host sync on CUDA")
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, DeviceResident) and (func is _T.cpu or (func is _T.to and _to_host(args, kwargs))):
            return out.as_subclass(torch.Tensor)  # brought to the host: ordinary memory from here
        return out


def as_device_resident(t: torch.Tensor) -> DeviceResident:
    """``t`` (same memory) as a ``DeviceResident``."""
    return t.as_subclass(DeviceResident)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Arm the calling thread: a host read of a ``DeviceResident`` raises ``HostSync`` inside."""
    _state.armed = getattr(_state, "armed", 0) + 1
    try:
        yield
    finally:
        _state.armed -= 1


@contextmanager
def allowed() -> Iterator[None]:
    """Within the block the calling thread may read (code that is not under test: SGLang's own)."""
    _state.allowed = getattr(_state, "allowed", 0) + 1
    try:
        yield
    finally:
        _state.allowed -= 1


def allowing(fn):
    """``fn`` wrapped to run inside ``allowed()``."""
    def wrapped(*args, **kwargs):
        with allowed():
            return fn(*args, **kwargs)
    wrapped.__wrapped__ = fn
    return wrapped


__all__ = ["DeviceResident", "HostSync", "allowed", "allowing", "as_device_resident", "no_host_sync"]
