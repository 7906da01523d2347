"""``LifecycleConnector``: kv-lifecycle behind vLLM 0.32's KV-connector API (``KVConnectorBase_V1``).

Loaded by module path, nothing of vLLM patched::

    kv_transfer_config={"kv_connector": "LifecycleConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "lifecycle.integrations.vllm.connector",
                        "kv_connector_extra_config": {...}}     # see lifecycle.integrations.vllm.config

vLLM builds it twice: in the scheduler process (``SCHEDULER`` role: ``store.StoreScheduler``, the
``DecodeOffloadManager`` and its proxy offloader) and in each worker (``WORKER`` role:
``worker.StoreWorker`` over vLLM's KV tensors, our host pool, storage tier and ``HostOffloader``).
They talk through the per-step metadata only: ``build_connector_meta`` sends the step's jobs
(``jobs.StepJobs``), ``build_connector_worker_meta`` sends back what ended (``jobs.Report``, added
across ranks by ``LifecycleWorkerMetadata.aggregate``).

Per step, on the worker: ``handle_preemptions`` (before the forward) waits for the copies reading
preempted requests' blocks; ``wait_for_save`` (after it) submits the step's copies, stores and frees
in order; ``get_finished`` reports the delayed requests whose copies all ended on this rank in
``finished_sending`` (vLLM frees their blocks once every rank has). Only requests that
``request_finished`` delayed are ever reported.

The load path (``get_num_new_matched_tokens``, ``update_state_after_alloc``'s loads, ``start_load_kv``,
``wait_for_layer_load``, ``finished_recving``, ``get_block_ids_with_load_errors``) is delegated to
``lookup.LoadPlanner`` (scheduler) and ``load.LoadWorker`` (workers), over the same tier and the
same page names (``_namespace_of``: the store path's seed).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from lifecycle.integrations.vllm import config as vconfig
from lifecycle.integrations.vllm import versions
from lifecycle.integrations.vllm.events import EventLog
from lifecycle.integrations.vllm.jobs import Report, StepJobs
from lifecycle.integrations.vllm.layout import CHANNELS, ROWS, VllmKVLayout
from lifecycle.integrations.vllm.store import StoreScheduler
from lifecycle.integrations.vllm.worker import PlacedHostPool, StoreWorker
from lifecycle.log import get_logger

log = get_logger("lifecycle.integrations.vllm")


class LifecycleConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: the store jobs and the load path's jobs."""

    def __init__(self, jobs: StepJobs, load_jobs: list | None = None) -> None:
        self.jobs = jobs
        self.load_jobs = load_jobs or []


class LifecycleWorkerMetadata(KVConnectorWorkerMetadata):
    """What one or more ranks report: ``jobs.Report`` (counts per copy / op, added on aggregate)
    and the load path's report (``load``: whatever ``load.LoadWorker`` returns, merged by it)."""

    def __init__(self, report: Report | None, load: Any = None) -> None:
        self.report = report
        self.load = load

    def aggregate(self, other: "LifecycleWorkerMetadata") -> "LifecycleWorkerMetadata":
        if self.report is None:
            report = other.report
        elif other.report is None:
            report = self.report
        else:
            report = self.report.merged(other.report)
        load = self.load
        if load is None:
            load = other.load
        elif other.load is not None and hasattr(load, "merged"):
            load = load.merged(other.load)
        return LifecycleWorkerMetadata(report, load)


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (a test building the worker in-process)
        return 0


def _kv_split() -> str:
    """The CPU backend splits K and V across rows; every other backend across channels."""
    try:
        from vllm.platforms import current_platform

        return ROWS if current_platform.is_cpu() else CHANNELS
    except Exception:  # noqa: BLE001
        return ROWS if not torch.cuda.is_available() else CHANNELS


class LifecycleConnector(KVConnectorBase_V1):
    """See the module docstring.

    Raises (at construction, one line, nothing started):
        VllmConfigError: an untested vLLM, or a configuration ``config.check_vllm`` refuses.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        versions.check()
        cfg = vconfig.read(vllm_config, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = cfg
        self.events = EventLog(cfg.block_size)
        self.store: StoreScheduler | None = None
        self.worker: StoreWorker | None = None
        self.layout: VllmKVLayout | None = None
        self.tp_rank = 0
        self._load_planner = None
        self._load_worker = None
        self.metrics = None
        if role == KVConnectorRole.SCHEDULER:
            world = int(getattr(vllm_config.parallel_config, "world_size", cfg.tp_size) or cfg.tp_size)
            self.store = StoreScheduler(
                cfg.block_size, cfg.num_blocks, cfg.host_pages(0), world=world,
                max_rows=4 * cfg.max_num_seqs + 16, max_len=cfg.max_model_len, namespace_seed=cfg.namespace_seed)
            self._lookup_storage = None
            self._load_planner = self._make_load_planner(kv_cache_config)
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") == "fail":
                log.warning("vllm.load_failure_policy_fail",
                            why="a prefix page that fails to load fails the request; set "
                                "kv_load_failure_policy='recompute' to recompute it instead")
            if cfg.metrics:
                from lifecycle.integrations.vllm.metrics import scheduler_metrics

                self.metrics = scheduler_metrics(self.store)
            log.info("vllm.connector_scheduler", block_size=cfg.block_size, blocks=cfg.num_blocks,
                     host_pages=cfg.host_pages(0), world=world, storage=cfg.storage)

    # --- the load path (lookup.LoadPlanner, load.LoadWorker) -----------------------------------------
    def _open_storage(self, tp_rank: int, page_nbytes: int, fmt):
        from transfer.storage.identity import DeploymentIdentity
        from transfer.storage.spec import open_storage

        identity = DeploymentIdentity(model_name=self.cfg.model_name, tp_rank=tp_rank, tp_size=self.cfg.tp_size)
        return open_storage(self.cfg.storage, page_nbytes=page_nbytes, identity=identity, page_format=fmt,
                            require_checksum=self.cfg.require_checksum)

    def _make_load_planner(self, kv_cache_config):
        try:
            from lifecycle.integrations.vllm.lookup import LoadPlanner  # noqa: PLC0415
        except ImportError:
            return None
        from transfer.storage.integrity import PageFormat

        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        shape = (2, self.cfg.block_size, len(group.layer_names), int(spec.num_kv_heads), int(spec.head_size))
        nbytes = 2 * self.cfg.block_size * len(group.layer_names) * int(spec.num_kv_heads) * int(spec.head_size) * (
            torch.empty((), dtype=spec.dtype).element_size())
        self._lookup_storage = self._open_storage(0, nbytes, PageFormat.of("page_first", spec.dtype, shape))
        return LoadPlanner(self._lookup_storage, self.cfg.block_size, namespace_seed=self.cfg.namespace_seed,
                           namespace_of=self._namespace_of)

    def _namespace_of(self, request):
        """The seed the store path names ``request``'s pages under (its ``cache_salt``, as SGLang
        0.5.23); a request the store path never stores (LoRA, multimodal, prompt embeddings) is a miss."""
        from lifecycle.errors import InvalidRequest
        from lifecycle.integrations.vllm.store import _storable

        if not _storable(request):
            raise InvalidRequest(f"request {request.request_id!r}: its pages are never stored (LoRA, multimodal "
                                 "or prompt embeddings)")
        return self.store.manager.namespace_of(request)

    def _make_load_worker(self, storage):
        try:
            from lifecycle.integrations.vllm.load import LoadWorker  # noqa: PLC0415
        except ImportError:
            return None
        return LoadWorker(self.layout, storage)

    # --- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._load_planner is None:
            return 0, False
        return self._load_planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()
        self.store.admitted(request, list(ids[0]) if ids else [])
        if self._load_planner is not None:
            self._load_planner.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        jobs = self.store.plan(scheduler_output)
        if self.metrics is not None:
            self.metrics.tick()
        load_jobs = self._load_planner.take_load_jobs() if self._load_planner is not None else []
        return LifecycleConnectorMetadata(jobs, load_jobs)

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        report = meta.report if isinstance(meta, LifecycleWorkerMetadata) else None
        if report is not None and report.events:
            self.events.add(report.events)
        self.store.completed(report, connector_output.finished_sending)
        if self._load_planner is not None and connector_output.finished_recving:
            self._load_planner.on_finished_recving(connector_output.finished_recving)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._load_planner is not None and self._load_planner.request_finished(request.request_id):
            # an async load still writes its blocks: freed when the worker reports it in
            # finished_recving (never also in finished_sending); it never ran a forward
            self.store.forget(request)
            return True, None
        return self.store.finished(request, block_ids), None

    def take_events(self):
        """vLLM's KV events for the pages this node stored (``BlockStored``, medium ``CPU`` when the
        tier is host memory, else ``STORAGE``) and removed; see ``events``."""
        if self.store is None:
            return []
        return self.events.take(self.store)

    def has_pending_push_work(self) -> bool:
        """True while copies (not expired), storage writes or delayed frees are unsettled: vLLM keeps
        stepping (calling ``build_connector_meta`` / ``update_connector_output``) until they are, so
        host pages come back and the last pages' events are published even when no request is left;
        never longer than ``write_timeout_s`` (else 30 s) without a completion coming back."""
        return self.store is not None and self.store.pending_work(self.cfg.write_timeout_s or 30.0)

    @property
    def requires_kv_delivery(self) -> bool:
        return False   # a cache: a dropped store is a miss

    # --- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from transfer.stack import page_format

        cfg = self.cfg
        self.layout = VllmKVLayout.from_kv_caches(kv_caches, cfg.block_size, kv_split=_kv_split())
        self.tp_rank = _rank()
        host = PlacedHostPool.for_layout(self.layout, cfg.host_pages(self.layout.page_nbytes),
                                         pin=None if self.layout.device.type == "cuda" else False,
                                         allow_pageable=True)
        storage = self._open_storage(self.tp_rank, host.page_nbytes, page_format(host))
        self.worker = StoreWorker(self.layout, host, storage, write_timeout_s=cfg.write_timeout_s,
                                  fence_timeout_s=cfg.fence_timeout_s, events=self.tp_rank == 0)
        self._load_worker = self._make_load_worker(storage)
        if cfg.metrics:
            from lifecycle.integrations.vllm.metrics import worker_metrics

            self.metrics = worker_metrics(self.worker, self.tp_rank)
        log.info("vllm.connector_worker", tp_rank=self.tp_rank, host_pages=host.num_pages,
                 storage=cfg.storage, **self.layout.describe())

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, LifecycleConnectorMetadata):
            if kv_connector_metadata.jobs.fence:
                self.worker.fence(kv_connector_metadata.jobs.fence)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._load_worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if meta.load_jobs:
                self._load_worker.start(meta.load_jobs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_worker is not None:
            self._load_worker.wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None   # whole pages are copied after the forward (wait_for_save), never per layer

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, LifecycleConnectorMetadata) and not meta.jobs.empty():
            self.worker.run(meta.jobs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self.worker.finished_sending() if self.worker is not None else set()
        recving = self._load_worker.finished_recving() if self._load_worker is not None else set()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_worker.load_error_block_ids() if self._load_worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.report() if self.worker is not None else None
        if self.metrics is not None:
            self.metrics.tick()
        load = None
        if self._load_worker is not None and hasattr(self._load_worker, "report"):
            load = self._load_worker.report()
        if report is None and load is None:
            return None
        return LifecycleWorkerMetadata(report, load)

    def shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.tick(force=True)
        if self._load_worker is not None:
            self._load_worker.close(5.0)
        if self.worker is not None:
            report = self.worker.close(5.0)
            try:
                self.worker.storage.close()
            finally:
                if report.clean:
                    self.worker.host.close()
                else:
                    self.worker.host.keep_pinned()
        if self.store is not None:
            if self._load_planner is not None:
                self._load_planner.close()
            if self._lookup_storage is not None:
                self._lookup_storage.close()
            self.store.manager.shutdown(force=True, timeout_s=1.0)


__all__ = ["LifecycleConnector", "LifecycleConnectorMetadata", "LifecycleWorkerMetadata"]
