"""What a Mooncake store may repair or remove: only what it wrote and can prove it wrote.

Mooncake's object names are SGLang's, so an object under one of our page names may be SGLang's (or
another writer's): written after Mooncake evicted ours, while our seal object stayed. So

* a page whose bytes do not match our seal is a miss, and nothing is removed — those bytes are
  not provably ours (they may be another writer's page, which it still reads);
* a page write that fails half-way removes only the objects that *this* put created: stored
  (``OK``) and absent from the existence check just before the put — never one that already
  existed (someone else's; Mooncake's put keeps an existing object and still answers ``OK``). An
  object another writer creates between that check and our put is indistinguishable from ours
  (Mooncake has no conditional remove): a window of one round trip;
* a page whose K/V objects exist but whose seal was evicted gets its seal back on ``batch_set``,
  after the K/V objects are read and found byte-identical to the page being written (then they
  are provably the bytes this seal describes); K/V of other bytes or another size are someone
  else's page (SGLang's, with other numerics): left alone and, as SGLang does, "already there" —
  ``batch_set`` reports it stored, counted ``foreign_kept``, never a failure nor a warning;
* a page whose seal proves another deployment wrote it (``integrity.written_by_another``: another
  layout, dtype, shape or page name — e.g. another attention-CP rank) is never added to nor
  deleted: ``batch_set`` finding that seal with a K/V object missing puts nothing (counted
  ``foreign_kept``), ``delete`` removes nothing (False, counted ``foreign_kept``).

A mixin of ``MooncakeStorage`` (uses its naming, buffers, counters and seal packing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transfer.log import get_logger
from transfer.storage.mooncake import conn
from transfer.storage.integrity import written_by_another

log = get_logger("transfer.storage.mooncake")


class MooncakeOwnership:
    """``_remove_created``, ``_reseal`` and ``_sealed_by_another`` for ``MooncakeStorage``."""

    def _sealed_by_another(self, store, keys: Sequence[str], fmts: Sequence) -> list[bool]:
        """Per key, whether its seal object (read now) proves another deployment wrote the page
        (``integrity.written_by_another`` against this store's name and ``fmts[i]``); counted
        ``foreign_kept`` where it does. A seal that cannot be read proves nothing (False)."""
        slot = self._SLOT
        buf = torch.zeros(len(keys) * slot, dtype=torch.uint8)
        names = [self.naming.seal_object(k) for k in keys]
        with self._buffers.registered([buf]):
            codes = store.batch_get_into(names, [buf.data_ptr() + j * slot for j in range(len(keys))],
                                         [slot] * len(keys))
        self._answered(codes, "read seal", "became unreachable (seal read)")
        out = []
        for j, (key, fmt, code) in enumerate(zip(keys, fmts, codes)):
            theirs = code == self._SEAL_NBYTES and written_by_another(
                buf.numpy()[j * slot:j * slot + self._SEAL_NBYTES], None, self.naming.page_name(key), fmt)
            if theirs:
                self._count(foreign_kept=1)
                log.debug("storage.foreign_page_kept", store="MooncakeStorage", name=self.naming.page_name(key))
            out.append(theirs)
        return out

    def _remove_created(self, store, names: Sequence[str], codes: Sequence[int], existed: Sequence[bool]) -> int:
        """Remove the objects of ``names`` this put created: code ``OK`` and not ``existed``
        before it. Returns how many were removed."""
        removed = 0
        for name, code, was in zip(names, codes, existed):
            if code == conn.OK and not was:
                removed += int(store.remove(name, True) == 0)
        return removed

    def _reseal(self, store, keys: Sequence[str], pages: Sequence[torch.Tensor], idx: list[int]) -> list[bool]:
        """Pages ``idx`` have every K/V object but no seal: read the objects back; where they are
        byte-identical to ``pages[i]``, store the seal again (``resealed``); where they hold other
        bytes or are of another size, leave them: another writer's page, already there (True,
        ``foreign_kept``, logged at debug only); where they could not be read (gone since the
        existence check, a dead holder), the page is not stored (False, ``errors``). Returns, per
        page of ``idx``, whether a page is stored under its name afterwards.

        Raises:
            StorageUnavailable: the master did not answer the read or the put (an outage, not a
                foreign page nor a failed page write; the breaker is told, as for the put)."""
        sizes_of = [pages[i].numel() * pages[i].element_size() for i in idx]
        scratch = torch.empty(sum(sizes_of), dtype=torch.uint8)
        names, ptrs, sizes, starts, pos = [], [], [], [], 0
        kinds = self.naming.kinds
        for i, nbytes in zip(idx, sizes_of):
            starts.append(pos)
            part = nbytes // kinds
            for k, name in enumerate(self.naming.objects(keys[i])):
                names.append(name), ptrs.append(scratch.data_ptr() + pos + k * part), sizes.append(part)
            pos += nbytes
        with self._buffers.registered([scratch]):
            codes = store.batch_get_into(names, ptrs, sizes)
        self._answered(codes, "read before reseal", "became unreachable during a write (reseal read)")
        ours, results = [], [False] * len(idx)
        for j, (i, nbytes) in enumerate(zip(idx, sizes_of)):
            got = codes[j * kinds:(j + 1) * kinds]
            part = nbytes // kinds
            if all(c == part for c in got):
                if torch.equal(scratch[starts[j]:starts[j] + nbytes], pages[i].reshape(-1).view(torch.uint8)):
                    ours.append(j)
                    continue
            elif not any(c == conn.TOO_BIG or (c >= 0 and c != part) for c in got):  # unreadable: proves nothing
                bad = next(c for c in got if c != part)
                self._count(errors=1)
                self._oplog.error("mooncake.write_failed", name=self.naming.page_name(keys[i]),
                                  code=conn.code_name(bad))
                continue
            results[j] = True  # other bytes, or another size: another writer's page, already there
            self._count(foreign_kept=1)
            log.debug("mooncake.not_ours", name=self.naming.page_name(keys[i]),
                      detail="objects under this page name hold other bytes and no seal of ours: left alone")
        if not ours:
            return results
        seals = torch.zeros(len(ours) * self._SLOT, dtype=torch.uint8)
        seal_names, seal_ptrs = [], []
        for n, j in enumerate(ours):
            i = idx[j]
            self._seal_into(seals, n, keys[i], pages[i])
            seal_names.append(self.naming.seal_object(keys[i]))
            seal_ptrs.append(seals.data_ptr() + n * self._SLOT)
        with self._buffers.registered([seals]):
            put = store.batch_put_from(seal_names, seal_ptrs, [self._SEAL_NBYTES] * len(ours), self._put_config)
        self._answered(put, "reseal", "became unreachable during a write (reseal)")
        resealed = 0
        for j, code in zip(ours, put):
            if code in (conn.OK, conn.EXISTS):
                results[j] = True
                resealed += 1
            else:
                self._count(errors=1)
                log.error("mooncake.write_failed", name=seal_names[ours.index(j)], code=conn.code_name(code))
        self._count(resealed=resealed)
        return results
