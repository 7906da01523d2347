"""Running the reference scheduler: validate, build the stack, serve the workload, shut down."""

from __future__ import annotations

import dataclasses
import inspect
import time

from lifecycle_tools.simulate.config import pool_bytes, validate
from lifecycle_tools.simulate.errors import ConfigProblem
from lifecycle_tools.simulate.report import RunReport
from lifecycle_tools.simulate.workload import iter_chats

CLOSE_TIMEOUT_S = 5.0   # per worker, when the stack is closed at the end of a run


def prepare(cfg) -> int:
    """Validate ``cfg`` (nothing generated, nothing allocated). Returns the row width ``build``
    needs. Raises ConfigProblem."""
    return validate(cfg)


def build(cfg, width: int, enqueue_timer=None):
    """The stack and manager for ``cfg`` (after ``prepare``).

    Raises:
        ConfigProblem: a part could not be built; the message names it (the storage backend, or
            the pools with their sizes).
    """
    import torch

    from lifecycle.manager import DecodeOffloadManager
    from transfer import build_stack
    from transfer.errors import StorageError

    spec = cfg.storage_spec
    try:
        stack = build_stack(
            cfg.layers, cfg.heads, cfg.head_dim, getattr(torch, cfg.torch_dtype_name()), cfg.page_size,
            cfg.device_tokens, cfg.host_tokens, cfg.rows, width, storage=spec, device=cfg.device,
            model_name=cfg.model_name(), storage_require_checksum=cfg.require_checksum,
            lookup_timeout_s=cfg.lookup_timeout)
    except StorageError as err:
        raise ConfigProblem(f"storage {spec!r}: {_one_line(err)}") from None
    except ImportError as err:
        raise ConfigProblem(f"storage {spec!r} needs a missing package: {err}") from None
    except (MemoryError, RuntimeError, ValueError) as err:
        sizes = ", ".join(f"{n} {b / 1e9:,.2f} GB" for n, b in pool_bytes(cfg, width).items())
        raise ConfigProblem(f"cannot allocate the pools on {cfg.device} ({sizes}): {_one_line(err)}") from None
    if enqueue_timer is not None:
        enqueue_timer.install(stack.offloader)
    try:
        mgr = DecodeOffloadManager.from_stack(stack, offload_stride=cfg.stride)
    except BaseException:
        stack.close()
        raise
    return stack, mgr


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def run(cfg, stack, mgr, progress=None, enqueue_timer=None) -> RunReport:
    """Serve the workload (twice with ``cfg.warm``: the second pass under new request ids hits the
    store), then shut the manager and stack down (bounded)."""
    from lifecycle_tools.simulate.scheduler import Simulator

    t0 = time.perf_counter()
    sim = Simulator(cfg, stack, mgr, progress, enqueue_timer)
    passes, clean = [], False
    try:
        passes.append(sim.run_pass(iter_chats(cfg), "cold" if cfg.warm else "run"))
        if cfg.warm:
            passes.append(sim.run_pass(iter_chats(cfg, prefix="w-"), "warm"))
        clean = True
    finally:
        sim.close()
        shut_down(mgr, stack, cfg.drain_timeout_s if clean else 0.0)
    st = stack.storage.stats()
    storage = {"spec": cfg.storage_spec, **{f: getattr(st, f) for f in st.__struct_fields__}}
    return RunReport(dataclasses.asdict(cfg), passes, storage, time.perf_counter() - t0)


def shut_down(mgr, stack, drain_s: float) -> None:
    """Settle copies for up to ``drain_s`` seconds, then shut the manager down (forced if copies
    are still in flight) and close the stack, waiting at most ``CLOSE_TIMEOUT_S`` per worker where
    the parts accept a timeout."""
    deadline = time.perf_counter() + drain_s
    while not mgr.idle() and time.perf_counter() < deadline:
        mgr.check_offload_progress()
        time.sleep(0.001)
    _call_bounded(stack.offloader.close)
    _call_bounded(mgr.shutdown, force=not mgr.idle())
    _call_bounded(stack.prefix_loader.close)
    stack.storage.close()


def _call_bounded(fn, **kwargs) -> None:
    params = inspect.signature(fn).parameters
    for name in ("timeout_s", "timeout"):
        if name in params:
            kwargs[name] = CLOSE_TIMEOUT_S
            break
    fn(**kwargs)
