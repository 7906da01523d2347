"""The release sink for SGLang: free a finished request's KV through SGLang's tree cache.

SGLang 0.5.19's own manager releases with (``_release_finished_req``)::

    tree_cache.free_kv_row(req.kv, ranges)      # one call: a page shared by two ranges freed once,
                                                # SWA-evicted slots freed on the full side only
    req_to_token_pool.free(req)                 # the row; sets req.kv.req_pool_idx = None
    req.kv.mark_kv_released()
    tree_cache.protected_size_ -= len(req.prefix_indices)

``SGLangReleaseSink`` does exactly that for the manager's one free path, after checking everything
those four steps rely on, so a refused release changes nothing.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

from lifecycle.release import ReleaseRefused
from lifecycle.integrations.sglang.errors import SGLangConfigError


class SGLangReleaseSink:
    """Frees through ``tree_cache.free_kv_row`` and ``req_to_token_pool.free``.

    Args:
        tree_cache: SGLang's prefix cache: ``free_kv_row(kv, ranges)`` and ``protected_size_``.
        req_to_token_pool: SGLang's ``ReqToTokenPool`` (``req_to_token``, ``free(req)``).
    Raises:
        SGLangConfigError: the tree cache lacks ``free_kv_row`` or ``protected_size_``.
    """

    def __init__(self, tree_cache, req_to_token_pool) -> None:
        if not callable(getattr(tree_cache, "free_kv_row", None)):
            raise SGLangConfigError(f"tree cache {type(tree_cache).__name__} has no free_kv_row(kv, ranges)")
        if not isinstance(getattr(tree_cache, "protected_size_", None), int):
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
                than the plan's, no ``mark_kv_released``, no ``prefix_indices``), the ranges are not
                ascending, disjoint and inside the row, ``protected_size_`` would go negative, or
                slots are quarantined (``free_kv_row`` frees whole ranges; the integration sets no
                copy deadline, so none ever are).
        """
        if self._sglang_frees and plan.req in self._sglang_frees:
            return
        req = plan.req
        rid = getattr(req, "rid", None)
        kv = getattr(req, "kv", None)
        row = getattr(kv, "req_pool_idx", None)
        if row is None or row == -1 or row != plan.row:
            raise ReleaseRefused(f"request {rid!r}: kv row {row!r} is not the row {plan.row} being released")
        if not callable(getattr(kv, "mark_kv_released", None)):
            raise ReleaseRefused(f"request {rid!r}: kv has no mark_kv_released()")
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
        """Release the request as SGLang does: slots (one call), row, kv record, protected count.
        False (nothing done) for a request SGLang frees itself (``released_by_sglang``)."""
        if self._sglang_frees and plan.req in self._sglang_frees:
            return False
        req = plan.req
        self.tree_cache.free_kv_row(req.kv, list(plan.ranges))
        self.req_to_token_pool.free(req)
        req.kv.mark_kv_released()
        self.tree_cache.protected_size_ -= len(req.prefix_indices)
        return True
