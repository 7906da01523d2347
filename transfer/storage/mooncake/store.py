"""Mooncake Store page storage, object-compatible with SGLang's Mooncake HiCache backend.

**Objects.** A page is stored as SGLang 0.5.19 stores it (``transfer.storage.mooncake.keys``):
MHA as ``{prefix}_{hash}_{tp}_k`` and ``_v`` (the two halves of our page, zero-copy), MLA as one
``{prefix}_{hash}__k``; the bytes are the raw page, no header. So an SGLang node using Mooncake
reads our pages and we read its pages.

**Integrity, and the trade-off.** A header in front of the bytes would make our objects unreadable
to SGLang (it reads exactly ``page_size * layers * heads * dim * itemsize`` bytes per object).
Instead each page we write gets a second, 104-byte object, ``{prefix}_{hash}_{tp}_kvlp``: the seal
of ``transfer.storage.integrity`` over the whole page (name, format, XXH3-128 of K||V). The seal
goes in the same ``batch_put_from`` as the page objects (per-object cost dominates small pages),
and a page whose seal write failed has the objects that write created removed again, so no page of ours stays
without its seal (a reader in between sees a complete page without one: served as unverified, or
a miss in strict mode — never wrong bytes). A read fetches the objects and the seal in one batch and
serves the page only when the seal verifies; a corrupt page is a miss and nothing of it is removed
(bytes that fail our seal are not provably ours: ``owned``). A page with
no seal (written by SGLang) is served and counted ``unverified`` (a warning the first time), or
is a miss with ``require_checksum``. Costs: one more object per page on the master and in each
read/write batch (~104 bytes); and two nodes racing to write the same new page may pair one's
seal with the other's bytes — harmless when the KV is bit-identical, a refused (recomputed) page
when it is not. ``seal=False`` writes pure SGLang objects only.

**Failures** never reach the caller as a hang or a crash: see ``MooncakeStorage``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import torch

from transfer.errors import InvalidPage, StorageConfigError, StorageUnavailable
from transfer.log import RateLimitedLog, get_logger
from transfer.storage.mooncake import conn
from transfer.storage.base import Storage, StorageStats
from transfer.storage.checks import check_batch, check_store
from transfer.storage.breaker import CircuitBreaker
from transfer.storage.integrity import SEAL_NBYTES, PageFormat, Verdict, check_keys, seal, verify
from transfer.storage.mooncake.owned import MooncakeOwnership
from transfer.storage.mooncake.session import ClientSession, tracked
from transfer.storage.identity import DeploymentIdentity
from transfer.storage.mooncake.keys import MooncakeNaming

log = get_logger("transfer.storage.mooncake")  # the package's logger, as owned.py's
_SLOT = 128  # bytes per seal in a batch's seal buffer (>= SEAL_NBYTES)


class MooncakeStorageStats(StorageStats):
    """``StorageStats`` plus what Mooncake adds: pages lost with a dead replica holder
    (``holder_gone``), pages refused for lack of space (``no_space``) and pages whose evicted seal
    ``batch_set`` stored again after checking their bytes (``resealed``)."""

    holder_gone: int = 0
    no_space: int = 0
    resealed: int = 0


class MooncakeStorage(MooncakeOwnership, ClientSession, Storage):
    """Pages in a Mooncake store (see the module docstring for objects and integrity).

    Args:
        settings: ``conn.MooncakeSettings`` (``parse_spec`` of a ``mooncake://`` URL).
        suffix: must be '' or the identity's file suffix: object names come from ``identity``,
            never from parsing a suffix.
        page_nbytes: required page size.
        identity: the deployment identity the object names are built from
            (``MooncakeNaming.of``). None: SGLang's unnamed deployment (no model, tp rank 0), MLA
            when ``page_format`` has the 4 dims of an MLA page.
        page_format: what the pages are (recorded in seals, checked on read); None: each page's
            own dtype and shape, layout ``raw``.
        require_checksum: a page without a seal is a miss (also the ``require_checksum`` option).
    Raises:
        StorageUnavailable: the extra is missing; or (unless ``lazy``) the master is unreachable or
            setup did not finish in time — in bounded time, one line naming the master.
        StorageConfigError: bad settings; a suffix that is not the identity's.

    Failure behaviour: every operation checks the client's health flag (instant) and a
    ``CircuitBreaker``; while the master is away ``batch_get`` misses and ``batch_exists``,
    ``batch_set`` and ``delete`` raise ``StorageUnavailable`` — without blocking (``PrefixLoader``
    turns a raising lookup into a counted miss). ``batch_exists`` additionally has a deadline
    (``exists_timeout_s``); a check that misses it raises and opens the breaker. Reads and
    writes wait for Mooncake's own bounded RPC timeouts (they run on storage workers, and their
    buffers must not be abandoned). After a master restart (empty) the client re-registers by
    itself and writes resume; a dead replica holder makes its pages misses (``holder_gone``).
    """

    # Until the master drops a dead holder (its client_ttl, 10 s by default) a read picks one replica
    # at random and fails (TRANSFER_FAIL) when it is the dead one: such objects are read again.
    READ_RETRIES = 2
    _SLOT, _SEAL_NBYTES = _SLOT, SEAL_NBYTES

    def __init__(self, settings: conn.MooncakeSettings, suffix: str = "", page_nbytes: int | None = None,
                 *, identity: DeploymentIdentity | None = None, page_format: PageFormat | None = None,
                 require_checksum: bool = False) -> None:
        check_store(page_nbytes, page_format)
        conn.import_store()
        if require_checksum and not settings.require_checksum:
            settings = msgspec.structs.replace(settings, require_checksum=True)
        if identity is None:
            identity = DeploymentIdentity(mla=page_format is not None and len(page_format.shape) == 4)
        if suffix and suffix != identity.file_suffix:
            raise StorageConfigError(f"mooncake objects are named from the deployment identity ({identity.describe()}), "
                                     f"not from the suffix {suffix!r}")
        self.settings, self.identity, self.page_nbytes = settings, identity, page_nbytes
        self.suffix = identity.file_suffix
        self.naming = MooncakeNaming.of(identity)
        if page_nbytes is not None and page_nbytes % self.naming.kinds:
            raise StorageConfigError(f"an MHA page must split into equal K and V halves, got page_nbytes={page_nbytes}")
        self.page_format = page_format
        self.url = f"mooncake://{settings.master}"
        self.breaker = CircuitBreaker(self.url)
        self._oplog = RateLimitedLog(log)   # per-page failures: one line per event per interval
        self._stats = MooncakeStorageStats()
        self._warned_unverified = False
        self._exists_busy = threading.Lock()
        ClientSession.__init__(self, settings)

    def _usable(self, what: str):
        """The client when the tier may be asked now, else None (counted ``unavailable``)."""
        store = self._store
        if store is not None and not self._closed.is_set() and self.breaker.allow():
            if store.health_check() == 0:
                return store
            self.breaker.failure(f"client unhealthy ({what})")
        with self._lock:
            self._stats.unavailable += 1
        return None

    def _require(self, what: str):
        store = self._usable(what)
        if store is None:
            raise StorageUnavailable(f"mooncake storage at {self.url} is unavailable ({what})")
        return store

    def _outcome(self, codes: Sequence[int], what: str) -> bool:
        """Report the tier's health from a batch's codes; True when the master answered."""
        bad = next((c for c in codes if c in conn.UNREACHABLE_CODES), None)
        if bad is None:
            self.breaker.success()
            return True
        self.breaker.failure(f"{what}: {conn.code_name(bad)}")
        with self._lock:
            self._stats.errors += 1
        return False

    def _answered(self, codes: Sequence[int], what: str, unreachable: str) -> None:
        """``_outcome``; when the master did not answer, raise ``StorageUnavailable`` saying it
        ``unreachable`` (e.g. "is unreachable (set)")."""
        if not self._outcome(codes, what):
            raise StorageUnavailable(f"mooncake storage at {self.url} {unreachable}")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def _format(self, page: torch.Tensor) -> PageFormat:
        return self.page_format if self.page_format is not None else PageFormat.raw(page)

    def _check(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
        """``checks.check_batch``, and every page splits into its objects (MHA: equal K and V)."""
        check_batch(keys, pages, self.page_nbytes)
        kinds = self.naming.kinds
        for page in pages:
            if (page.numel() * page.element_size()) % kinds:
                raise InvalidPage(f"an MHA page must split into equal K and V halves, "
                                  f"got {page.numel() * page.element_size()} bytes")

    def _slices(self, page: torch.Tensor) -> list[tuple[int, int]]:
        """(pointer, size) of each object of ``page`` (checked by ``_check``): K and V halves, or
        the whole MLA page."""
        kinds = self.naming.kinds
        part = page.numel() * page.element_size() // kinds
        return [(page.data_ptr() + i * part, part) for i in range(kinds)]

    # -- Storage --------------------------------------------------------------------------------
    @tracked
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_set``. Pages whose objects (and, when sealing, seal) all exist are
        skipped (first writer wins, as in SGLang). A page whose K/V exist without its seal (the
        seal evicted) gets the seal back when the K/V bytes are this page's, else it is someone
        else's page and stays untouched — already there (True, ``foreign_kept``, no warning); so
        does a page whose seal proves another deployment wrote it and whose K or V is gone
        (``owned``). Raises ``StorageUnavailable`` when the master is away (nothing
        written)."""
        self._check(keys, pages)
        results = [False] * len(keys)
        if not keys:
            return results
        store = self._require("set")
        sealed = self.settings.seal
        objects = [self.naming.objects(k) for k in keys]
        names = []
        for key, objs in zip(keys, objects):
            names += objs + ([self.naming.seal_object(key)] if sealed else [])
        codes = store.batch_is_exist(names)
        self._answered(codes, "exists before set", "is unreachable (set)")
        kinds, step = self.naming.kinds, self.naming.kinds + int(sealed)
        todo, reseal = [], []
        for i in range(len(keys)):
            page_codes = codes[i * step:(i + 1) * step]
            if not all(c == 1 for c in page_codes[:kinds]):
                todo.append(i)
            elif sealed and page_codes[kinds] != 1:
                reseal.append(i)
            else:
                results[i] = True
        self._count(skipped=len(keys) - len(todo) - len(reseal))
        partial = [i for i in todo if sealed and codes[i * step + kinds] == 1]  # a seal, a K/V object missing
        if partial:  # another deployment's page (its seal says so) is never added to: already there
            theirs = {i for i, t in zip(partial, self._sealed_by_another(
                store, [keys[i] for i in partial], [self._format(pages[i]) for i in partial])) if t}
            for i in theirs:
                results[i] = True
            todo = [i for i in todo if i not in theirs]
        if reseal:
            for i, ok in zip(reseal, self._reseal(store, keys, pages, reseal)):
                results[i] = ok
        if todo:
            existed = {i: [c == 1 for c in codes[i * step:i * step + kinds]] for i in todo}
            for i, ok in zip(todo, self._put_pages(store, keys, pages, objects, todo, existed)):
                results[i] = ok
        return results

    def _seal_into(self, seals: torch.Tensor, j: int, key: str, page: torch.Tensor) -> None:
        """Write page ``key``'s seal into slot ``j`` of the seal buffer ``seals``."""
        data = page.reshape(-1).view(torch.uint8).numpy()
        stamp = seal(self.naming.page_name(key), self._format(page), data)
        seals.numpy()[j * _SLOT:j * _SLOT + SEAL_NBYTES] = memoryview(stamp)

    def _put_pages(self, store, keys, pages, objects, todo: list[int], existed: dict[int, list[bool]]) -> list[bool]:
        """One ``batch_put_from`` of every page's objects, each page's seal object with them
        (one round of transfers: per-object cost dominates small pages). A page whose seal was
        not stored has the objects this put created removed again — never one that ``existed``
        before it (someone else's: Mooncake's put keeps an existing object and still answers
        ``OK``) — so no page of ours stays without a seal. A page whose seal was stored while a
        K/V object failed keeps what was stored (the seal covers this page's name and bytes: early,
        not wrong): it reads as a miss until the next ``batch_set`` of it puts the missing object."""
        seals = torch.zeros(len(todo) * _SLOT, dtype=torch.uint8)
        sealed = self.settings.seal
        groups, ptrs, sizes = [], [], []
        for j, i in enumerate(todo):
            group = list(objects[i])
            slices = self._slices(pages[i])
            if sealed:
                self._seal_into(seals, j, keys[i], pages[i])
                group.append(self.naming.seal_object(keys[i]))
                slices.append((seals.data_ptr() + j * _SLOT, SEAL_NBYTES))
            groups.append(group)
            ptrs += [p for p, _ in slices]
            sizes += [n for _, n in slices]
        with self._buffers.registered([seals] + [pages[i] for i in todo]):
            codes = store.batch_put_from([o for g in groups for o in g], ptrs, sizes, self._put_config)
        ok = self._put_codes(codes, groups)
        if sealed:
            pos = 0
            for j, group in enumerate(groups):
                group_codes = codes[pos:pos + len(group)]
                pos += len(group)
                if not ok[j] and group_codes[-1] not in (conn.OK, conn.EXISTS):
                    self._remove_created(store, group[:-1], group_codes[:-1], existed[todo[j]])
        self._count(stored=sum(ok))
        if self.events is not None:
            self.events.stored([keys[todo[j]] for j, good in enumerate(ok) if good])
        return ok

    def _put_codes(self, codes: Sequence[int], groups: list[list[str]]) -> list[bool]:
        """Per group of objects, whether every put succeeded; failures counted and logged."""
        self._answered(codes, "put", "became unreachable during a write")
        out, pos = [], 0
        for names in groups:
            group = codes[pos:pos + len(names)]
            pos += len(names)
            bad = next((c for c in group if c not in (conn.OK, conn.EXISTS)), None)
            if bad is not None:
                self._count(errors=1, no_space=int(bad == conn.NO_SPACE))
                self._oplog.error("mooncake.write_failed", name=names[0], code=conn.code_name(bad))
            out.append(bad is None)
        return out

    @tracked
    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_get``: a page is served only when all its objects were read in full
        and (when sealed) its seal verifies. The master away: all misses, without blocking."""
        self._check(keys, into)
        if not keys:
            return []
        store = self._usable("get")
        if store is None:
            self._count(misses=len(keys))
            return [False] * len(keys)
        kinds, n = self.naming.kinds, len(keys)
        seals = torch.zeros(n * _SLOT, dtype=torch.uint8)
        names, ptrs, sizes = [], [], []
        for i, (key, buf) in enumerate(zip(keys, into)):
            for (ptr, size), name in zip(self._slices(buf), self.naming.objects(key)):
                names.append(name), ptrs.append(ptr), sizes.append(size)
            names.append(self.naming.seal_object(key)), ptrs.append(seals.data_ptr() + i * _SLOT)
            sizes.append(_SLOT)
        with self._buffers.registered([seals, *into]):
            codes = store.batch_get_into(names, ptrs, sizes)
            for _ in range(self.READ_RETRIES):
                again = [j for j, c in enumerate(codes) if c == conn.ABSENT_HOLDER]
                if not again:
                    break
                for j, c in zip(again, store.batch_get_into([names[j] for j in again], [ptrs[j] for j in again],
                                                            [sizes[j] for j in again])):
                    codes[j] = c
        self._outcome(codes, "get")
        step = kinds + 1
        results = [self._judge(store, key, buf, codes[i * step:(i + 1) * step], sizes[i * step],
                               seals[i * _SLOT:(i + 1) * _SLOT])
                   for i, (key, buf) in enumerate(zip(keys, into))]
        self._count(hits=sum(results), misses=n - sum(results))
        return results

    def _judge(self, store, key: str, buf: torch.Tensor, codes, part: int, seal_buf: torch.Tensor) -> bool:
        """Whether page ``key`` just read into ``buf`` is served; a refused page's bytes are zeroed."""
        *page_codes, seal_code = codes
        verdict = None
        if any(c == conn.ABSENT_HOLDER for c in page_codes):
            self._count(holder_gone=1)
        elif any(c == conn.TOO_BIG or (c >= 0 and c != part) for c in page_codes):
            verdict = Verdict.WRONG_SIZE
        elif all(c == part for c in page_codes):
            if seal_code == SEAL_NBYTES:
                data = buf.reshape(-1).view(torch.uint8).numpy()
                verdict = verify(seal_buf.numpy()[:SEAL_NBYTES], self.naming.page_name(key), self._format(buf), data)
                if verdict is Verdict.OK:
                    return True
            elif seal_code in conn.MISSING_CODES and not self.settings.require_checksum:
                self._unverified(key)
                return True
            elif seal_code >= 0:
                verdict = Verdict.CORRUPT  # a seal object of another size
        buf.zero_()
        if verdict is not None:  # nothing is removed: bytes that fail our seal are not provably ours
            self._count(**{verdict.value: 1})
            self._oplog.error("mooncake.page_refused", name=self.naming.page_name(key), verdict=verdict.value)
        return False

    def _unverified(self, key: str) -> None:
        with self._lock:
            self._stats.unverified += 1
            first, self._warned_unverified = not self._warned_unverified, True
        if first:
            log.warning("mooncake.unverified_page", name=self.naming.page_name(key),
                        detail="page without a seal (written by SGLang?) served; require_checksum=1 refuses them")

    def batch_exists(self, keys: Sequence[str]) -> int:
        """See ``Storage.batch_exists``. Bounded by ``exists_timeout_s`` (a check runs on a helper
        thread). Raises ``StorageUnavailable`` at once while the master is away (breaker open, or
        the client unhealthy), and when the check misses its deadline (which opens the breaker) —
        so a caller such as ``PrefixLoader`` counts the miss."""
        check_keys(keys)
        if not keys:
            return 0
        store = self._require("exists")
        step = self.naming.kinds + int(self.settings.require_checksum)
        names = []
        for key in keys:
            names += self.naming.objects(key)
            if self.settings.require_checksum:
                names.append(self.naming.seal_object(key))
        codes = self._exists_codes(store, names)
        if not self._outcome(codes, "exists"):
            raise StorageUnavailable(f"mooncake storage at {self.url} is unreachable (exists)")
        n = 0
        while n < len(keys) and all(c == 1 for c in codes[n * step:(n + 1) * step]):
            n += 1
        return n

    def _exists_codes(self, store, names: list[str]) -> list[int]:
        """``batch_is_exist`` on the helper thread, waited for at most ``exists_timeout_s``."""
        deadline = self.settings.exists_timeout_s
        if not self._exists_busy.acquire(timeout=min(0.01, deadline)):  # one still running: the tier is slow
            self._count(unavailable=1)
            raise StorageUnavailable(f"mooncake storage at {self.url}: an existence check is still running")
        try:
            future = self._exists_pool.submit(self._exists_call, store, names)
        except RuntimeError:  # closed meanwhile
            self._exists_busy.release()
            raise StorageUnavailable(f"mooncake storage at {self.url} is closed") from None
        try:
            return future.result(deadline)
        except FutureTimeout:
            self.breaker.failure(f"existence check exceeded {deadline} s")
            self._count(unavailable=1)
            raise StorageUnavailable(f"mooncake storage at {self.url}: existence check exceeded {deadline} s") from None

    def _exists_call(self, store, names: list[str]) -> list[int]:
        try:
            return store.batch_is_exist(names)
        finally:
            self._exists_busy.release()

    @tracked
    def delete(self, key: str) -> bool:
        """See ``Storage.delete``: removes the page's objects and seal (even under a read lease),
        unless the seal proves another deployment wrote the page (``integrity.written_by_another``):
        then nothing is removed (False, counted ``foreign_kept``). Raises ``StorageUnavailable``
        when the master is away."""
        check_keys([key])
        store = self._require("delete")
        if self.settings.seal and self._sealed_by_another(store, [key], [self.page_format])[0]:
            return False
        names = self.naming.objects(key)
        codes = [store.remove(name, True) for name in names]
        store.remove(self.naming.seal_object(key), True)
        if not self._outcome(codes, "delete"):
            raise StorageUnavailable(f"mooncake storage at {self.url} is unreachable (delete)")
        gone = any(c == conn.OK for c in codes)
        self._count(deletes=int(gone))
        if gone and self.events is not None:
            self.events.removed([key])
        return gone

    def stats(self) -> MooncakeStorageStats:
        """A snapshot of this client's counters (``pages`` / ``bytes`` stay 0: the store is shared
        and evicts by itself; its contents are the master's to report)."""
        with self._lock:
            return msgspec.structs.replace(self._stats)
