"""``RedisStorage``'s read path (a mixin, one concept per file): ``batch_get`` reads each value
from the socket straight into the caller's page tensor (``reader``) and verifies its seal
there; see ``transfer.storage.redis.store`` for the store's contracts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from transfer.errors import StorageUnavailable
from transfer.log import get_logger
from transfer.storage.checks import check_batch
from transfer.storage.integrity import MAGIC, SEAL_NBYTES, SEAL_VERSION, Verdict, name_fingerprint, raw_format, seal, verify

log = get_logger("transfer.storage.redis")
_MAGIC_VERSION = MAGIC + bytes([SEAL_VERSION])


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    if t.dtype is torch.uint8 and t.dim() == 1:  # host page_bytes views: no reshape needed
        return memoryview(t.numpy())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class RedisReads:
    """``batch_get`` and its helpers; mixed into ``RedisStorage`` (uses its client, reader, index,
    counters and breaker)."""

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_get``. A page failing its checks is a miss (its bytes are never
        left in ``into[i]``). Raises ``StorageUnavailable`` when the server is unreachable.

        Each value is read from the socket straight into ``into[i]`` (``reader``) and its
        seal verified there, over the page name, format and the bytes in place."""
        check_batch(keys, into, self.page_nbytes)
        n = len(keys)
        results = [False] * n
        sizes = [t.numel() * t.element_size() for t in into]
        prefix, suffix = self.key_prefix, self.suffix
        for run in self._batches(n, sizes):
            names = [prefix + keys[i] + suffix for i in run]
            dests = [_raw(into[i]) for i in run]
            corrupt: list[str] = []
            check = self._read_checker(keys, into, run, names, dests, results, corrupt)
            try:
                self._guarded(lambda: self._read_wire([x.encode() for x in names], dests, check), "get")
            except BaseException:
                for i, dest in zip(run, dests):  # a page cut off mid-read: never leave its bytes
                    if not results[i]:
                        dest[:] = bytes(dest.nbytes)
                raise
            self._settle_reads(run, names, sizes, results)
            if corrupt:
                try:
                    self._run(lambda p: p.delete(*corrupt), "delete corrupt")
                except StorageUnavailable:
                    pass
        return results

    def _read_checker(self, keys, into, run, names, dests, results, corrupt):
        """The ``on_reply`` of one read round trip: verifies reply j's page where it was read
        (``dests[j]``) and records ``results[run[j]]``.

        Fast path: the value's seal equals, byte for byte, the seal ``batch_set`` writes for this
        exact page (``integrity.seal``: its (format, size) fields cached from a real ``seal``, the
        name fingerprint and the XXH3-128 over descriptor + the page bytes in place computed
        here). It can only say yes for exactly that seal; anything else goes to
        ``_verify_read`` (``integrity.verify``), which decides and says why."""
        suffix, fixed_format, fields = self.suffix, self.page_format, self._seal_fields

        def check(j, reply, head):
            if type(reply) is int:  # a value; the page is in dests[j] when its length fits
                i, dst = run[j], dests[j]
                page = into[i]
                fmt = fixed_format if fixed_format is not None else raw_format(page)
                name, nbytes = keys[i] + suffix, dst.nbytes
                fixed = fields.get((fmt, nbytes))
                if fixed is not None and reply == SEAL_NBYTES + nbytes:
                    digest = xxhash.xxh3_128(fmt.descriptor(name, nbytes))
                    digest.update(dst)
                    if head == b"".join((fixed[0], digest.digest(), name_fingerprint(name).to_bytes(8, "little"),
                                         fixed[1])):
                        results[i] = True
                        return
                results[i] = self._verify_read(names[j], head, reply, dst, page, corrupt)
            elif reply is not None:
                self._count("errors")
                self._oplog.error("redis_storage.read_failed", name=names[j], error=str(reply))
        return check

    def _read_wire(self, names: list[bytes], dests: list[memoryview], on_reply) -> list:
        """``GET`` each name into its destination (``reader``); per name its reply."""
        return self._reader.get_into(self._client, names, self.ttl_ms, dests, on_reply)

    def _settle_reads(self, run, names, sizes, results) -> None:
        """A read round trip's bookkeeping: hits, misses and the client-side index."""
        evicted = []
        with self._lock:
            for i, name in zip(run, names):
                if results[i]:
                    self._stats.hits += 1
                    if not self._index.touch(name):
                        evicted += self._index.add(name, sizes[i])
                else:
                    self._stats.misses += 1
                    self._index.remove(name)
        self._evict(evicted)

    def _verify_read(self, name: str, head: memoryview, length: int, dst: memoryview, into: torch.Tensor,
                     corrupt: list[str]) -> bool:
        """Whether the value just read (seal ``head``, ``length`` bytes; the body in ``dst`` when
        the length fits) is exactly our page; a refused page's bytes are zeroed in ``dst``."""
        body_nbytes = length - SEAL_NBYTES
        sealed_nbytes = (int.from_bytes(head[8:16], "little")
                         if length >= SEAL_NBYTES and head[:5] == _MAGIC_VERSION else -1)
        if sealed_nbytes < 0 or sealed_nbytes != body_nbytes:  # not a page, or a torn/truncated one
            verdict = Verdict.CORRUPT
        elif sealed_nbytes != dst.nbytes:
            verdict = Verdict.WRONG_SIZE
        else:
            fmt = self._format(into)
            verdict = verify(head, name[len(self.key_prefix):], fmt, dst)
        if verdict is Verdict.OK:
            if len(self._seal_fields) < 64:  # the (format, size) part of this seal, for the fast path
                whole = seal(name[len(self.key_prefix):], fmt, dst)
                self._seal_fields[(fmt, dst.nbytes)] = (whole[:16], whole[40:])
            return True
        if body_nbytes == dst.nbytes:  # the body was read into the caller's buffer
            dst[:] = bytes(dst.nbytes)
        self._count(verdict.value)
        if verdict is Verdict.CORRUPT:
            corrupt.append(name)
        self._oplog.error("redis_storage.page_refused", name=name, verdict=verdict.value, size=length)
        return False
