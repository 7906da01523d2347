"""Running the reference scheduler: validate, build the stack, serve the workload, shut down."""

from __future__ import annotations

import dataclasses
import gc
import time

from lifecycle_tools.simulate.config import pool_bytes, validate
from lifecycle_tools.simulate.errors import ConfigProblem
from lifecycle_tools.simulate.report import RunReport
from lifecycle_tools.simulate.workload import iter_chats

CLOSE_TIMEOUT_S = 5.0   # bound on the manager's shutdown and on the stack's close at the end of a run
CUT_OFF = ("tier down", "tier stalled")   # how a pass's drain ends when it stops waiting for the tier


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


def run(cfg, stack, mgr, progress=None, enqueue_timer=None, freeze_gc: bool = False, telemetry=None) -> RunReport:
    """Serve the workload (twice with ``cfg.warm``: the second pass under new request ids hits the
    store), then shut the manager and stack down (bounded). ``telemetry`` (a started
    ``telemetry.Telemetry``) sees every step and every drain iteration, and gets the final
    ``NodeStats``.

    With ``freeze_gc`` (what ``kv-lifecycle simulate`` does), once everything is built and warm
    (imports, pools, stack, manager, scheduler) the heap is collected once and frozen
    (``gc.freeze()``), so the cycle collector's full collections during the run walk only what the
    run allocates, not torch's ~170k objects (docs/integration.md); unfrozen when the run ends.
    """
    from lifecycle.node_stats import from_stack
    from lifecycle_tools.simulate.scheduler import Simulator

    t0 = time.perf_counter()
    sim = Simulator(cfg, stack, mgr, progress, enqueue_timer, None if telemetry is None else telemetry.on_step,
                    None if telemetry is None else telemetry.on_wait)
    if freeze_gc:
        gc.collect()
        gc.freeze()
    passes, clean = [], False
    try:
        passes.append(sim.run_pass(iter_chats(cfg), "cold" if cfg.warm else "run"))
        if cfg.warm:
            passes.append(sim.run_pass(iter_chats(cfg, prefix="w-"), "warm"))
        clean = True
    finally:
        if freeze_gc:
            gc.unfreeze()
        sim.close(CLOSE_TIMEOUT_S)
        if not clean:   # interrupted or failed: abandon what is in flight, in bounded time
            shut_down(mgr, stack, 0.0)
    # each pass has drained already (copies up to drain_timeout_s, storage work while the tier
    # worked): what is left was cut off and counted there, so the shutdown waits for nothing more,
    # and the closes do not wait for storage work the drain gave up on
    cut = any(p.drain_end in CUT_OFF for p in passes)
    note = shut_down(mgr, stack, 0.0, 0.0 if cut else CLOSE_TIMEOUT_S)
    final = from_stack(mgr, stack)   # one NodeStats: the report, --json and the metrics
    if telemetry is not None:
        telemetry.finish(final)
    st = final.tiers[0].storage
    storage = {"spec": cfg.storage_spec, **{f: getattr(st, f) for f in st.__struct_fields__}}
    return RunReport(dataclasses.asdict(cfg), passes, storage, time.perf_counter() - t0, note,
                     stats=final.to_builtins())


def shut_down(mgr, stack, drain_s: float, close_s: float = CLOSE_TIMEOUT_S) -> str:
    """Settle copies for up to ``drain_s`` seconds, then shut the manager down (forced if work is
    still pending) and close the stack, the two together bounded by ``close_s`` (default
    ``CLOSE_TIMEOUT_S``): the stack's close gets what the shutdown left.

    Returns:
        "" when everything finished, else what was abandoned (for the report).
    """
    deadline = time.perf_counter() + drain_s
    while not mgr.idle() and time.perf_counter() < deadline:
        mgr.check_offload_progress()
        time.sleep(0.001)
    closing = time.perf_counter() + close_s    # one bound for the manager's shutdown and the stack's close
    pending = mgr.shutdown(force=not mgr.idle(), timeout_s=close_s)
    closed = stack.close(timeout=max(0.0, closing - time.perf_counter()))
    notes = []
    if pending.copies or pending.storage_ops:
        notes.append(f"manager shut down with {pending.copies} copies and {pending.storage_ops} storage ops pending")
    if not closed.clean:
        notes.append(f"stack closed with {len(closed.abandoned_writes)} copies and "
                     f"{len(closed.abandoned_storage)} storage ops abandoned")
    return "; ".join(notes)
