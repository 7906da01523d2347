"""Copy engines: run chunk copies between the device KV pool and host pages without blocking.

``CpuCopyEngine`` runs copies on worker threads. ``CudaCopyEngine`` launches them on a copy
stream of its own (``OwnStream``: created outside PyTorch's stream pool, so never one of SGLang's
streams; destroyed once the engine is closed and drained) that first waits on the compute stream,
and detects completion by querying CUDA events (never synchronizing the caller). Both report finished tags through ``poll``, possibly out
of submission order, each exactly once.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from transfer.gather import DEFAULT_STAGING_BYTES, ChunkCopy, Staging, check_staging_bytes
from transfer.host_pool import HostPool
from transfer.kv_pool import KVPool
from transfer.worker import BackgroundWorker, Done
from transfer.errors import Closed, DeviceMismatch
from transfer.log import get_logger

log = get_logger(__name__)

#: ``cudaStreamNonBlocking`` / ``CU_STREAM_NON_BLOCKING``: no implicit ordering with the legacy
#: default stream (what PyTorch's pool streams are created with)
NON_BLOCKING = 1


class StreamApi:
    """Create and destroy a CUDA stream outside PyTorch's stream pool, through ctypes: the CUDA
    runtime torch loaded (``cudaStreamCreateWithFlags`` / ``cudaStreamDestroy``), else the driver
    (``cuStreamCreate`` / ``cuStreamDestroy_v2``). A stream so made is the caller's alone: PyTorch
    hands out its own streams round-robin from a pool of 32 per priority, so a second
    ``torch.cuda.Stream()`` in the process (SGLang's forward, result-copy and schedule streams are
    three) can be the same stream.

    Args:
        lib: the loaded library (``ctypes.CDLL``, or a stand-in with the same two functions).
        driver: ``lib`` is libcuda (the driver API), not libcudart.
    """

    def __init__(self, lib, driver: bool = False) -> None:
        self.lib, self.driver = lib, driver
        self.name = "cuStreamCreate" if driver else "cudaStreamCreateWithFlags"

    def create(self, flags: int = NON_BLOCKING) -> int:
        """A new stream on the current device; its handle.

        Raises:
            RuntimeError: the call failed (its return code).
        """
        handle = ctypes.c_void_p()
        fn = self.lib.cuStreamCreate if self.driver else self.lib.cudaStreamCreateWithFlags
        rc = int(fn(ctypes.byref(handle), ctypes.c_uint(flags)))
        if rc != 0 or not handle.value:
            raise RuntimeError(f"{self.name} failed (rc={rc})")
        return int(handle.value)

    def destroy(self, handle: int) -> int:
        """Destroy stream ``handle``; the call's return code (0: destroyed)."""
        fn = self.lib.cuStreamDestroy_v2 if self.driver else self.lib.cudaStreamDestroy
        return int(fn(ctypes.c_void_p(handle)))


def stream_api() -> StreamApi | None:
    """The ``StreamApi`` of this process's CUDA (the runtime torch loaded, found in
    ``/proc/self/maps``, else ``libcuda.so.1``); None without a usable CUDA or either library."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # torch's libcudart loaded and the device's context current
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            if hasattr(lib, "cudaStreamCreateWithFlags") and hasattr(lib, "cudaStreamDestroy"):
                return StreamApi(lib)
        except OSError:
            continue
    try:
        return StreamApi(ctypes.CDLL("libcuda.so.1"), driver=True)
    except OSError:
        return None


class OwnStream:
    """The copy engine's stream: created outside PyTorch's pool (``StreamApi``, non-blocking) on
    ``device`` and wrapped as a ``torch.cuda.ExternalStream``; destroyed by ``close`` (the engine
    calls it once every copy on it has finished). Without a ``StreamApi`` (or if creating fails):
    a stream from PyTorch's pool, with a warning (it may be one SGLang also uses).

    Args:
        device: the CUDA device.
        api: how to create and destroy it (default ``stream_api()``).
        wrap: ``(handle, device) -> stream`` (default ``torch.cuda.ExternalStream``).
        pool: ``device -> stream``, the fallback (default ``torch.cuda.Stream``).
    """

    def __init__(self, device: torch.device | str, api: StreamApi | None = None,
                 wrap: Callable[[int, torch.device], Any] | None = None,
                 pool: Callable[[torch.device], Any] | None = None) -> None:
        self.device = torch.device(device)
        self.api = api if api is not None else stream_api()
        self.handle: int | None = None
        self.destroyed = False
        why = "no CUDA runtime to create one with" if self.api is None else None
        if self.api is not None:
            try:
                with _on_device(self.device):
                    self.handle = self.api.create(NON_BLOCKING)
            except (RuntimeError, OSError, AttributeError) as err:
                why = str(err)
        if self.handle is None:
            log.warning("copy_engine.pool_stream", device=str(self.device), reason=why,
                        risk="a pool stream may be one SGLang's scheduler also uses")
            self.stream = (pool or torch.cuda.Stream)(self.device)
            return
        self.stream = (wrap or _external)(self.handle, self.device)

    @property
    def own(self) -> bool:
        """Whether the stream is ours (not from PyTorch's pool)."""
        return self.handle is not None

    def close(self) -> None:
        """Destroy the stream (ours only; idempotent). Only once nothing is queued on it and no
        tensor can still record an event on it: the engine calls it once drained."""
        if self.handle is None or self.destroyed:
            return
        self.destroyed = True
        rc = self.api.destroy(self.handle)
        if rc != 0:
            log.warning("copy_engine.stream_destroy_failed", rc=rc, handle=self.handle)


def _on_device(device: torch.device):
    """The context that makes ``device`` current (a no-op without CUDA: the stand-in tests)."""
    import contextlib

    cuda = device.type == "cuda" and torch.cuda.is_available()
    return torch.cuda.device(device) if cuda else contextlib.nullcontext()


def _external(handle: int, device: torch.device):
    return torch.cuda.ExternalStream(handle, device=device)


class CpuCopyEngine:
    """Copies on ``threads`` worker threads (torch releases the GIL while copying), between pools
    in host memory only: a device (CUDA) pool is refused (``DeviceMismatch``), since a worker
    thread would copy it outside any stream order and report it done at launch, not landing.

    Args:
        threads: worker threads; with more than one, completions may come out of order.
    """

    def __init__(self, threads: int = 2) -> None:
        self._worker = BackgroundWorker("kv-copy", threads)

    @property
    def pending(self) -> int:
        """Copies submitted and not yet reported by ``poll``."""
        return self._worker.pending

    def check_pool(self, kv) -> None:
        """Raise ``DeviceMismatch`` unless ``kv`` (a device KV pool) lives in host memory."""
        device = kv.device  # a torch.device (KVPool, LayeredKVPool): one attribute read per copy
        if device.type != "cpu":
            raise DeviceMismatch(
                f"{type(self).__name__} copies host-memory pools only; this pool is on {device} "
                f"(use the CUDA engine: make_copy_engine({str(device)!r}))")

    def submit(self, tag: Any, fn: Callable[[], Any]) -> None:
        """Run ``fn`` as one copy job; ``poll`` reports ``tag`` when it has run."""
        self._worker.submit(tag, fn)

    def to_host(self, tag: Any, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                check_end: int | None = None) -> None:
        """Enqueue device ``slots`` -> host ``host_pages`` (same page count, whole aligned pages).

        The plan is built and run on the worker: the caller's thread only queues the job (and
        never reads ``slots``). With ``check_end`` the worker first checks ``slots`` are whole
        aligned pages inside ``0 .. check_end-1``; if not, the copy fails (``Done.error``).

        Raises:
            DeviceMismatch: ``kv`` is not in host memory (nothing queued).
        """
        self.check_pool(kv)
        self.submit(tag, lambda: ChunkCopy(kv, host, slots, host_pages, check_end).to_host())

    def to_device(self, tag: Any, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                  check_end: int | None = None) -> None:
        """Enqueue host ``host_pages`` -> device ``slots`` (planned and run on the worker).

        Raises:
            DeviceMismatch: ``kv`` is not in host memory (nothing queued).
        """
        self.check_pool(kv)
        self.submit(tag, lambda: ChunkCopy(kv, host, slots, host_pages, check_end).to_device())

    def poll(self) -> list[Done]:
        """Copies finished since the last call (``Done.error`` set if one raised). Never blocks."""
        return self._worker.poll()

    def unfinished(self) -> list:
        """Tags of copies queued or still running. Never blocks."""
        return self._worker.unfinished()

    def alive(self) -> bool:
        """Whether a copy thread is still running (after a ``close`` that timed out)."""
        return self._worker.alive()

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued copies and stop the threads, waiting at most ``timeout`` s in all
        (None: until they end). A copy cannot be cancelled: a stuck thread is left running.

        Returns:
            True when every copy thread has ended.
        """
        return self._worker.close(timeout)


class CudaCopyEngine:
    """Copies on a dedicated CUDA stream, completion by event query.

    Args:
        device: the CUDA device of the KV pool.
        staging_bytes: the most bytes the copy stream's staging buffer holds (``gather.Staging``: a
            larger chunk is copied in pieces that fit; at least one page).
    Raises:
        RuntimeError: CUDA is not available.
        ValueError: ``staging_bytes`` is not a positive int.
    """

    def __init__(self, device: torch.device | str = "cuda", staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        check_staging_bytes(staging_bytes)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA")
        self.device = torch.device(device)
        #: the copy stream: our own, not from PyTorch's pool (``OwnStream``); destroyed once closed and drained
        self._own_stream = OwnStream(self.device)
        self.stream = self._own_stream.stream
        #: the copy stream's one staging buffer (only ever used on ``stream``), within its budget
        self.staging_buffer = Staging(self.device, staging_bytes)
        # (tag, event, (the launch, what it returned), launch error): held until the event fires
        self._inflight: list[tuple[Any, torch.cuda.Event, tuple, BaseException | None]] = []
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._inflight)

    def check_pool(self, kv) -> None:
        """Raise ``DeviceMismatch`` unless ``kv`` lives on this engine's CUDA device."""
        device = torch.device(kv.device)
        if device.type != "cuda" or _cuda_index(device) != _cuda_index(self.device):
            raise DeviceMismatch(f"{type(self).__name__} on {self.device} cannot copy a pool on {device}")

    def submit(self, tag: Any, fn: Callable[[], Any]) -> None:
        """Launch ``fn`` on the copy stream after the compute stream's queued work.

        The stream rule (docs/architecture.md): the copy stream first waits on the caller's current
        stream (``wait_stream``), so everything queued there before (the forward writing the KV,
        the kernel that filled the slot ids) is ordered before the copy; ``fn`` allocates what it
        needs on the copy stream; whatever ``fn`` returns (and ``fn`` itself, with everything its
        closure holds) stays referenced until the copy's event, recorded on the copy stream after
        the launch, has fired. If ``fn`` raises while launching, the tag is still reported once by
        ``poll``, with ``Done.error`` set, after that event (work it did launch has finished, and
        what it launched with stayed alive until then).
        """
        if self._closed:
            raise Closed("copy engine is closed")
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        done = torch.cuda.Event()
        error = None
        with torch.cuda.stream(self.stream):
            try:
                keep = fn()
            except Exception as err:  # reported through poll, like the CPU engine's worker
                keep, error = None, err
            done.record(self.stream)
        self._inflight.append((tag, done, (fn, keep), error))

    def _launch(self, make: Callable[[], Any], method: str, inputs: tuple = ()) -> Callable[[], Any]:
        """A launch that builds its plan on the copy stream (``make``) and runs ``method``; the
        plan is held by the closure from the moment it exists, so a launch failing half way keeps
        what it queued alive until the event. ``inputs`` (tensors made on another stream) are held
        by the closure as well, until the event: no ``record_stream`` on the copy stream (a tensor
        so marked records an event on it when freed, which would outlive the stream's ``close``)."""
        held: list = []

        def go() -> Any:
            held.append(inputs)
            plan = make()
            held.append(plan)
            getattr(plan, method)()
            return plan
        return go

    def to_host(self, tag: Any, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                check_end: int | None = None) -> None:
        """Device ``slots`` -> host ``host_pages``, planned and launched on the copy stream; with
        ``check_end`` the slot ids are checked on the device (``gather.check_on_device``) and a bad
        chunk is reported by ``poll`` with ``Done.error`` (never read on the host here)."""
        self.check_pool(kv)
        self.submit(tag, self._launch(lambda: ChunkCopy(kv, host, slots, host_pages, check_end, self.staging_buffer),
                                      "to_host", (slots,)))

    def to_device(self, tag: Any, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                  check_end: int | None = None) -> None:
        self.check_pool(kv)
        self.submit(tag, self._launch(lambda: ChunkCopy(kv, host, slots, host_pages, check_end, self.staging_buffer),
                                      "to_device", (slots,)))

    def poll(self) -> list[Done]:
        """Copies whose event has fired (``event.query()``); never synchronizes. A copy whose
        device-side index check failed is reported with ``Done.error`` (read from pinned memory)."""
        done, still = [], []
        for entry in self._inflight:
            (done if entry[1].query() else still).append(entry)
        self._inflight = still
        out = []
        for tag, _, (_, plan), error in done:
            if error is None:
                check = getattr(plan, "landed_error", None)
                error = check() if check is not None else None
            out.append(Done(tag, error=error))
        if self._closed:
            self._drained()
        return out

    def unfinished(self) -> list:
        """Tags of copies whose event has not fired yet. Never synchronizes."""
        return [tag for tag, event, _, _ in self._inflight if not event.query()]

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new copies and wait for in-flight ones, at most ``timeout`` s (None: until the
        copy stream drains). The wait polls the copies' events (a hung copy is left in flight,
        never synchronized on when a timeout is given); they stay reported by ``poll``.

        Returns:
            True when every copy has finished.
        Raises:
            ValueError: ``timeout`` negative.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        self._closed = True
        if timeout is None:
            self.stream.synchronize()
            self._drained()
            return True
        deadline = time.monotonic() + timeout
        while self.unfinished():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        self._drained()
        return True

    def _drained(self) -> None:
        """Closed and every copy's event fired: nothing will use the copy stream again; destroy it
        (``poll`` calls this too, for a close that timed out)."""
        if self._closed and not any(not e.query() for _, e, _, _ in self._inflight):
            self._own_stream.close()


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


CopyEngine = CpuCopyEngine | CudaCopyEngine


def make_copy_engine(device: torch.device | str, threads: int = 2) -> CopyEngine:
    """The engine for a KV pool on ``device``: the CUDA stream engine on CUDA, worker threads on
    the CPU.

    Raises:
        DeviceMismatch: ``device`` is neither the CPU nor a usable CUDA device.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaCopyEngine(device)
    if device.type != "cpu":
        raise DeviceMismatch(f"no copy engine for a pool on {device} (CUDA available: {torch.cuda.is_available()})")
    return CpuCopyEngine(threads)
