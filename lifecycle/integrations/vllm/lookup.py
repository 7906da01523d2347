"""The scheduler side of loading stored prefixes into vLLM (``LoadPlanner``).

vLLM asks the connector, for each waiting request, how many tokens beyond its local prefix-cache
hit it can load (``get_num_new_matched_tokens``). The planner answers from storage without ever
waiting on it on the scheduler thread:

* the first ask copies the loadable part of ``request.all_token_ids`` and queues one lookup on a
  helper thread (at most ``max_pending`` queued or running; beyond that the ask is a miss, 0): the
  page names from our sha256 chain (``hashing.page_hashes``, the names an SGLang node gives the
  same tokens, from the request's namespace seed) and the tier's ``batch_exists`` over them;
* until it answers, the ask returns ``None`` (vLLM asks again on a later step); a lookup older than
  ``lookup_timeout_s``, a tier that raised, or a tier behind an open ``CircuitBreaker`` is a miss
  (0), counted in ``stats()`` (``transfer.prefix.PrefixStats``) and reported to the breaker;
* the answer is whole pages only, never the request's last token (vLLM computes at least one),
  beyond ``num_computed_tokens`` (a local hit that is not a whole page is a miss: 0). Asking again
  repeats the answer (side-effect free: nothing is planned until ``after_alloc``).

``after_alloc`` plans the load of ``num_external_tokens`` into the blocks vLLM allocated (decided on
that count, never on the blocks) as a ``LoadJob`` that ``take_load_jobs`` hands to the connector
metadata. A request whose load is in flight holds its blocks until the worker reports it in
``finished_recving`` (``request_finished`` says so; vLLM then frees them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

import hashing
from lifecycle.errors import ConfigError, InvalidRequest
from lifecycle.integrations.vllm.load import LoadJob
from lifecycle.log import get_logger
from transfer.errors import StorageError
from transfer.prefix import PrefixStats
from transfer.storage.base import Storage
from transfer.storage.breaker import CircuitBreaker

log = get_logger(__name__)

#: a lookup still unanswered after this long is a miss
DEFAULT_LOOKUP_TIMEOUT_S = 2.0


def request_namespace(request, seed: str | None = None) -> str | None:
    """The namespace seed of a vLLM request's page chain (the prior of its first page).

    A ``cache_salt`` is folded in as SGLang folds it (``hashing.namespace_seed(None, cache_salt)``),
    so a salted request is named as an SGLang node names the same salted request. A deployment
    ``seed`` is used for requests that name no namespace; a request naming another is refused.

    Raises:
        InvalidRequest: a LoRA or multimodal request (its KV depends on more than the tokens, and
            nothing in the names would say so), a ``cache_salt`` that is not a str, or a salt other
            than the deployment's ``seed``. Reads only.
    """
    rid = getattr(request, "request_id", None)
    if getattr(request, "lora_request", None) is not None:
        raise InvalidRequest(f"request {rid!r}: LoRA requests are not named (their KV depends on the adapter)")
    if getattr(request, "mm_features", None):
        raise InvalidRequest(f"request {rid!r}: multimodal requests are not named (their KV depends on the media)")
    salt = getattr(request, "cache_salt", None)
    if salt is None:
        return seed
    if not isinstance(salt, str):
        raise InvalidRequest(f"request {rid!r}: cache_salt {salt!r} is not a str")
    named = hashing.namespace_seed(None, salt)
    if seed is not None and named != seed:
        raise InvalidRequest(f"request {rid!r}: its cache_salt names another namespace than the seed {seed}")
    return named


class _Lookup:
    """One request's lookup: asked at page ``start``, over ``tokens`` (loadable pages only)."""

    __slots__ = ("num_tokens", "start", "last_start", "names", "future", "asked_at", "found")

    def __init__(self, num_tokens: int, start: int, future: Future | None, asked_at: float) -> None:
        self.num_tokens, self.start, self.future, self.asked_at = num_tokens, start, future, asked_at
        self.last_start = start  # the page after the local hit of the latest ask
        self.names: list[str] = []
        self.found: int | None = None  # pages found from page 0 (None: not answered yet)


class LoadPlanner:
    """Looks stored prefixes up off the scheduler thread and plans their loads into vLLM blocks.

    Args:
        storage: the tier to ask (``batch_exists`` over page hashes; its suffix names this
            deployment's pages, e.g. rank 0's).
        block_size: vLLM's block size (= our page size).
        namespace_seed: the deployment's namespace seed (64 hex characters) or None.
        namespace_of: ``request -> seed`` (default ``request_namespace`` with ``namespace_seed``); a
            request it refuses (``InvalidRequest``) is a miss, logged once per request.
        threads: lookup helper threads, >= 1.
        max_pending: lookups queued or running at most, >= 1 (an ask beyond it is a miss).
        lookup_timeout_s: a lookup unanswered this long is a miss (> 0).
        breaker: guards the tier (None: the store's ``breaker`` attribute, else a new one).
        load_async: answer vLLM that loads are asynchronous (the default: the request waits in
            ``WAITING_FOR_REMOTE_KVS`` while the worker loads between steps, and is reported in
            ``finished_recving``); False: the worker loads before the step's forward
            (``wait_for_layer_load`` waits for it).
        clock: monotonic seconds (tests may inject one).
    Raises:
        ConfigError: a bad size, count or deadline; a seed that is not 64 hex characters; a
            storage without ``batch_exists``. Nothing is started then.
    """

    def __init__(self, storage: Storage, block_size: int, *, namespace_seed: str | None = None,
                 namespace_of: Callable[[object], str | None] | None = None, threads: int = 1,
                 max_pending: int = 64, lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
                 breaker: CircuitBreaker | None = None, load_async: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for what, value in (("block_size", block_size), ("threads", threads), ("max_pending", max_pending)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{what} must be an int >= 1, got {value!r}")
        if isinstance(lookup_timeout_s, bool) or not isinstance(lookup_timeout_s, (int, float)) \
                or not lookup_timeout_s > 0:
            raise ConfigError(f"lookup_timeout_s must be a number > 0, got {lookup_timeout_s!r}")
        if namespace_seed is not None:
            if not isinstance(namespace_seed, str) or len(namespace_seed) != 64 \
                    or any(c not in "0123456789abcdefABCDEF" for c in namespace_seed):
                raise ConfigError(f"namespace_seed must be 64 hex characters, got {namespace_seed!r}")
            namespace_seed = namespace_seed.lower()
        if not callable(getattr(storage, "batch_exists", None)):
            raise ConfigError(f"storage {storage!r} has no batch_exists")
        self.storage, self.block_size, self.load_async = storage, block_size, bool(load_async)
        self.namespace_seed = namespace_seed
        self._namespace_of = namespace_of or (lambda req: request_namespace(req, namespace_seed))
        self.max_pending, self.lookup_timeout_s = max_pending, float(lookup_timeout_s)
        self.breaker = breaker or getattr(storage, "breaker", None) or CircuitBreaker(type(storage).__name__)
        self._clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kv-vllm-lookup")
        self._running = 0                      # lookups queued or running (guarded by _lock)
        self._lock = threading.Lock()
        self._lookups: dict[str, _Lookup] = {}  # per waiting request (scheduler thread only)
        self._inflight: set[str] = set()        # requests whose load job is out (scheduler thread)
        self._jobs: list[LoadJob] = []
        self._refused: set[str] = set()         # requests logged as unnameable
        self._stats = PrefixStats()
        self._closed = False

    # -- get_num_new_matched_tokens -----------------------------------------------------------
    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: ``(tokens loadable beyond num_computed_tokens,
        load asynchronously)``; ``(None, False)`` while the lookup is pending. Never blocks on
        storage, never raises for it; nothing is planned (vLLM may ask again and again)."""
        if self._closed:
            return 0, False
        req_id = request.request_id
        num_tokens = request.num_tokens
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False  # a local hit that is not a whole page: nothing to add page-wise
        start = num_computed_tokens // bs
        loadable = (num_tokens - 1) // bs  # whole pages, never the last token
        if loadable <= start:
            self._lookups.pop(req_id, None)
            return 0, False
        entry = self._lookups.get(req_id)
        if entry is None or entry.num_tokens != num_tokens or start < entry.start:
            entry = self._submit(request, req_id, num_tokens, start, loadable)
            if entry is None:
                return 0, False
        entry.last_start = start
        if entry.found is None:
            if not entry.future.done():
                if self._clock() - entry.asked_at < self.lookup_timeout_s:
                    return None, False
                entry.future.cancel()
                self._count("timed_out")
                self.breaker.failure(f"lookup took longer than {self.lookup_timeout_s}s")
                entry.found = 0
            else:
                self._settle(entry)
        end = min(entry.found, loadable)
        if end <= start:
            return 0, False
        return (end - start) * bs, self.load_async

    def _submit(self, request, req_id: str, num_tokens: int, start: int, loadable: int) -> _Lookup | None:
        try:
            seed = self._namespace_of(request)
        except InvalidRequest as err:
            if req_id not in self._refused:
                self._refused.add(req_id)
                log.info("vllm.load.request_not_named", request=req_id, reason=str(err))
            return None
        if not self.breaker.allow():
            self._count("skipped")
            return self._answered(req_id, num_tokens, start, 0)
        with self._lock:
            if self._running >= self.max_pending:
                full = True
            else:
                full = False
                self._running += 1
        if full:
            self._count("skipped")
            return None
        tokens = request.all_token_ids[: loadable * self.block_size]  # a list copy (ConstantList slice)
        if not isinstance(tokens, list):
            tokens = list(tokens)
        try:
            future = self._pool.submit(self._lookup, tokens, seed, start)
        except RuntimeError:  # the pool was shut down under us
            with self._lock:
                self._running -= 1
            return None
        future.add_done_callback(self._ended)  # run, failed or cancelled: no longer pending
        entry = _Lookup(num_tokens, start, future, self._clock())
        self._lookups[req_id] = entry
        return entry

    def _answered(self, req_id: str, num_tokens: int, start: int, found: int) -> _Lookup:
        entry = _Lookup(num_tokens, start, None, self._clock())
        entry.found = found
        self._lookups[req_id] = entry
        return entry

    def _lookup(self, tokens: list[int], seed: str | None, start: int) -> tuple[list[str], int]:
        """On a helper thread: the names of ``tokens``' pages and how many lead in storage
        (pages ``0 .. start-1`` are vLLM's local hit and are not asked for)."""
        names = hashing.page_hashes(tokens, self.block_size, seed)
        n = self.storage.batch_exists(names[start:]) if start < len(names) else 0
        return names, start + n

    def _ended(self, _future: Future) -> None:
        with self._lock:
            self._running -= 1

    def _settle(self, entry: _Lookup) -> None:
        """Read a finished lookup's answer into ``entry`` (a failed tier is a miss)."""
        try:
            names, found = entry.future.result(0)
        except (StorageError, OSError) as err:
            self._count("failed")
            self.breaker.failure(err)
            entry.found = 0
            return
        except Exception as err:  # a bad token id, a bug: a miss, logged, never the scheduler
            log.warning("vllm.load.lookup_failed", error=repr(err))
            self._count("failed")
            entry.found = 0
            return
        self.breaker.success()
        entry.names, entry.found = names, found
        with self._lock:
            self._stats.lookups += 1
            self._stats.pages_looked_up += max(0, len(names) - entry.start)
            self._stats.hits += found > entry.start
            self._stats.pages_found += max(0, found - entry.start)

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    # -- update_state_after_alloc -------------------------------------------------------------
    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: plan the load of ``num_external_tokens`` (decided on
        that count, not on ``blocks``) into the blocks vLLM allocated after the local hit. The
        lookup's answer is consumed either way (a later ask looks up afresh).

        Raises:
            InvalidRequest: ``num_external_tokens`` this planner did not answer for the request
                (nothing is planned then).
        """
        req_id = request.request_id
        entry = self._lookups.get(req_id)
        if num_external_tokens:
            bs = self.block_size
            if entry is None or entry.found is None or num_external_tokens % bs \
                    or entry.last_start + num_external_tokens // bs > entry.found:
                raise InvalidRequest(f"request {req_id!r}: {num_external_tokens} external tokens were never "
                                     f"answered by this connector's lookup")
            first, n = entry.last_start, num_external_tokens // bs
            block_ids = blocks.get_block_ids()[0]
            if len(block_ids) < first + n:
                raise InvalidRequest(f"request {req_id!r}: {len(block_ids)} blocks cannot hold pages "
                                     f"{first}..{first + n - 1}")
            job = LoadJob(req_id, entry.names[first:first + n], [int(b) for b in block_ids[first:first + n]],
                          sync=not self.load_async)
            self._jobs.append(job)
            if self.load_async:
                self._inflight.add(req_id)
        self._lookups.pop(req_id, None)
        self._refused.discard(req_id)

    def take_load_jobs(self) -> list[LoadJob]:
        """The jobs planned since the last call (for ``build_connector_meta``)."""
        jobs, self._jobs = self._jobs, []
        return jobs

    # -- update_connector_output / request_finished -------------------------------------------
    def on_finished_recving(self, req_ids) -> None:
        """The worker loaded (or failed to load) these requests' pages: their loads are over."""
        for req_id in req_ids or ():
            self._inflight.discard(req_id)

    def loading(self, req_id: str) -> bool:
        """Whether a load into ``req_id``'s blocks is planned or in flight (not yet reported in
        ``finished_recving``)."""
        return req_id in self._inflight

    def request_finished(self, req_id: str) -> bool:
        """Forget the request's lookup. Returns True when a load into its blocks is still in flight:
        the blocks must stay held (``delay_free``) until the worker reports the request in
        ``finished_recving``, which is when vLLM frees them."""
        self._lookups.pop(req_id, None)
        self._refused.discard(req_id)
        return req_id in self._inflight

    def stats(self) -> PrefixStats:
        """A snapshot of the lookup counters (``loads``/``pages_loaded`` are the worker's)."""
        with self._lock:
            return msgspec.structs.replace(self._stats)

    def pending(self) -> int:
        """Lookups queued or running."""
        with self._lock:
            return self._running

    def close(self) -> None:
        """Stop looking up: later asks are misses; a lookup stuck on a hung tier is abandoned."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
