"""Verification of what the manager stored: a bounded uniform sample of the pages it offloaded,
read back from storage after the pass and compared byte for byte with the KV they came from."""

from __future__ import annotations

import random

import torch

import hashing
from lifecycle_tools.simulate.kvdata import SyntheticKV, page_first
from lifecycle_tools.simulate.report import PassReport
from transfer.errors import StorageError


class PageSample:
    """A uniform sample (reservoir sampling) of the pages offloaded during a pass.

    Args:
        mode: ``"none"``, ``"all"`` (keeps every page: memory grows with the run) or a count.
        seed: makes the sample a function of the workload.
        page_size: tokens per page.
    Only the sampled pages are hashed and kept (their key, position and ``page_size`` KV digests).
    """

    def __init__(self, mode: str, seed: int, page_size: int) -> None:
        self.limit = None if mode == "all" else 0 if mode == "none" else int(mode)
        self.rng = random.Random(seed)
        self.ps = page_size
        self.population = 0
        self.items: list[tuple[str, torch.Tensor, int]] = []

    def _slot(self) -> int | None:
        """Where the next page goes in the sample (None: not sampled)."""
        k = self.population
        self.population += 1
        if self.limit is None or k < self.limit:
            self.items.append(None)
            return len(self.items) - 1
        j = self.rng.randrange(k + 1)
        return j if j < self.limit else None

    def offer(self, seq: list[int], kvids: torch.Tensor, first: int, last: int, seed: str | None = None) -> None:
        """Pages ``[first, last)`` of ``seq`` were stored by the manager, its chain starting at
        ``seed`` (the request's namespace, ``DecodeOffloadManager.namespace_of``)."""
        chosen = [(i, s) for i in range(first, last) if (s := self._slot()) is not None]
        if not chosen:
            return
        hashes = hashing.page_hashes(seq[: last * self.ps], self.ps, seed)
        for i, s in chosen:
            pos = i * self.ps
            self.items[s] = (hashes[i], kvids[pos:pos + self.ps].clone(), pos)


def verify_sample(sample: PageSample, storage, host_pool, kv: SyntheticKV, rep: PassReport) -> None:
    """Read every sampled page back from ``storage`` and compare it with its expected bytes."""
    before = storage.stats()
    try:
        _read_back(sample, storage, host_pool, kv, rep)
    finally:
        after = storage.stats()
        rep.verify_refused_corrupt = after.corrupt - before.corrupt
        rep.verify_refused_foreign = (after.foreign - before.foreign) + (after.wrong_size - before.wrong_size)


def integrity_of_pass(rep: PassReport, before, after) -> None:
    """The pass's integrity rows from the store's counters at its start and after verification."""
    rep.pages_refused_corrupt = after.corrupt - before.corrupt
    rep.pages_refused_foreign = (after.foreign - before.foreign) + (after.wrong_size - before.wrong_size)
    rep.pages_served_unverified = after.unverified - before.unverified
    rep.storage_evictions = after.evictions - before.evictions


def _read_back(sample: PageSample, storage, host_pool, kv: SyntheticKV, rep: PassReport) -> None:
    pages = {key: (kvids, pos) for key, kvids, pos in sample.items}
    keys = sorted(pages)
    rep.verify_population, rep.verify_sampled = sample.population, len(keys)
    batch = max(1, min(64, host_pool.available_size() // host_pool.page_size))
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        bufs = [torch.empty(host_pool.page_nbytes, dtype=torch.uint8) for _ in part]
        try:
            got = storage.batch_get(part, bufs)
        except StorageError as err:
            rep.verify_unavailable += len(part)
            rep.error(f"verification read: {type(err).__name__}: {err}")
            continue
        for key, ok, buf in zip(part, got, bufs):
            if not ok:
                rep.verify_missing += 1
                continue
            kvids, pos = pages[key]
            want = page_first(kv.values(kvids, torch.arange(pos, pos + kv.ps)), 1, kv.ps)[0]
            if torch.equal(buf, want):
                rep.verify_ok += 1
            else:
                rep.verify_mismatched += 1
