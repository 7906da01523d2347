"""The release sink for SGLang: free a finished request's KV through SGLang's tree cache.

SGLang 0.5.19's own manager releases with (``_release_finished_req``)::

    tree_cache.free_kv_row(req.kv, ranges)      # one call: a page shared by two ranges freed once,
                                                # SWA-evicted slots freed on the full side only
    req_to_token_pool.free(req)                 # the row; sets req.kv.req_pool_idx = None
    req.kv.mark_kv_released()
    tree_cache.protected_size_ -= len(req.prefix_indices)

SGLang 0.5.23's (the prefix its prealloc match took from the tree stays the tree's, unlocked)::

    tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.kv.kv_allocated_len)])
    tree_cache.unlock(req.lock)
    req.lock = None
    req_to_token_pool.free(req)
    req.kv.mark_kv_released()

``SGLangReleaseSink`` does exactly what the release in force does (``versions.Release``) for the
manager's one free path, after checking everything those steps rely on, so a refused release
changes nothing.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

from lifecycle.release import ReleaseRefused
from lifecycle.integrations.sglang.errors import SGLangConfigError
from lifecycle.integrations.sglang.versions import TESTED, Release


class SGLangReleaseSink:
    """Frees through ``tree_cache.free_kv_row`` and ``req_to_token_pool.free``, as the release in
    force does (see the module docstring).

    Args:
        tree_cache: SGLang's prefix cache: ``free_kv_row(kv, ranges)``, and ``protected_size_``
            (0.5.19) or ``unlock(lock)`` (0.5.23).
        req_to_token_pool: SGLang's ``ReqToTokenPool`` (``req_to_token``, ``free(req)``).
        release: the SGLang release (``versions.Release``); default 0.5.19's.
    Raises:
        SGLangConfigError: the tree cache lacks ``free_kv_row``, or ``protected_size_`` (0.5.19) /
            ``unlock`` (0.5.23).
    """

    def __init__(self, tree_cache, req_to_token_pool, release: Release | None = None) -> None:
        self.release = release or Release(None, TESTED[0], "default")
        self.through_lock = self.release.releases_through_tree_lock
        if not callable(getattr(tree_cache, "free_kv_row", None)):
            raise SGLangConfigError(f"tree cache {type(tree_cache).__name__} has no free_kv_row(kv, ranges)")
        if self.through_lock:
            if not callable(getattr(tree_cache, "unlock", None)):
                raise SGLangConfigError(
                    f"tree cache {type(tree_cache).__name__} has no unlock(lock) (SGLang {self.release.behaves_as})")
        elif not isinstance(getattr(tree_cache, "protected_size_", None), int):
            raise SGLangConfigError(f"tree cache {type(tree_cache).__name__} has no integer protected_size_")
        self.tree_cache, self.req_to_token_pool = tree_cache, req_to_token_pool
        self._sglang_frees: weakref.WeakSet = weakref.WeakSet()

    @contextmanager
    def released_by_sglang(self, req) -> Iterator[None]:
        """Within the block, a release of ``req`` has no effect and nothing to check: SGLang is
        about to free the request itself (``release_kv_cache``), so the lifecycle only records it.
        Releases of other requests in the block free as usual."""
        self._sglang_frees.add(req)
        try:
            yield
        finally:
            self._sglang_frees.discard(req)

    def check(self, plan) -> None:
        """Everything ``free`` relies on, checked without any effect.

        Raises:
            ReleaseRefused: the request's ``kv`` cannot be released this way (no row, a row other
                than the plan's, no ``mark_kv_released``; 0.5.19: no ``prefix_indices``, or
                ``protected_size_`` would go negative; 0.5.23: ``kv.cache_protected_len`` not an
                int in ``[0, kv.kv_allocated_len]``), the ranges are not ascending, disjoint and
                inside the row, or slots are quarantined (``free_kv_row`` frees whole ranges; the
                integration sets no copy deadline, so none ever are).
        """
        if self._sglang_frees.data and plan.req in self._sglang_frees:
            return
        req = plan.req
        rid = getattr(req, "rid", None)
        kv = getattr(req, "kv", None)
        row = getattr(kv, "req_pool_idx", None)
        if row is None or row == -1 or row != plan.row:
            raise ReleaseRefused(f"request {rid!r}: kv row {row!r} is not the row {plan.row} being released")
        if not callable(getattr(kv, "mark_kv_released", None)):
            raise ReleaseRefused(f"request {rid!r}: kv has no mark_kv_released()")
        if self.through_lock:
            protected, allocated = getattr(kv, "cache_protected_len", None), getattr(kv, "kv_allocated_len", None)
            if not (isinstance(protected, int) and isinstance(allocated, int) and 0 <= protected <= allocated):
                raise ReleaseRefused(
                    f"request {rid!r}: kv.cache_protected_len {protected!r} is not an int in "
                    f"[0, kv_allocated_len {allocated!r}]")
        else:
            prefix = getattr(req, "prefix_indices", None)
            try:
                protected = len(prefix)
            except TypeError:
                raise ReleaseRefused(f"request {rid!r}: prefix_indices {prefix!r} has no length") from None
            if protected > self.tree_cache.protected_size_:
                raise ReleaseRefused(
                    f"request {rid!r}: {protected} prefix tokens but the tree cache protects only "
                    f"{self.tree_cache.protected_size_}")
        if plan.quarantined:
            raise ReleaseRefused(f"request {rid!r}: {plan.quarantined} slots are quarantined by a stuck copy")
        width = self.req_to_token_pool.req_to_token.shape[1]
        last = 0
        for start, end in plan.ranges:
            if not (last <= start < end <= width):
                raise ReleaseRefused(
                    f"request {rid!r}: release ranges {plan.ranges} are not ascending, disjoint, "
                    f"non-empty and inside the row (width {width})")
            last = end

    def free(self, plan) -> bool:
        """Release the request as SGLang does: slots (one call), row, kv record, and the protected
        count (0.5.19) or the tree lock (0.5.23). False (nothing done) for a request SGLang frees
        itself (``released_by_sglang``)."""
        if self._sglang_frees.data and plan.req in self._sglang_frees:
            return False
        req = plan.req
        if self.through_lock:
            kv = req.kv
            self.tree_cache.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
            self.tree_cache.unlock(getattr(req, "lock", None))
            req.lock = None
            self.req_to_token_pool.free(req)
            kv.mark_kv_released()
            return True
        self.tree_cache.free_kv_row(req.kv, list(plan.ranges))
        self.req_to_token_pool.free(req)
        req.kv.mark_kv_released()
        self.tree_cache.protected_size_ -= len(req.prefix_indices)
        return True
