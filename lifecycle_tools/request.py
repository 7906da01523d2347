"""A reference SGLang-shaped decode request: what ``DecodeOffloadManager`` reads from a request.

SGLang's scheduler hands the manager its ``Req`` objects; the manager reads ``rid``,
``origin_input_ids``, ``output_ids``, ``kv.req_pool_idx``, ``kv.kv_committed_len``,
``kv.kv_allocated_len`` and ``finished()`` (and, once, ``extra_key`` and ``cache_salt``: the
request's namespace), and keys its records weakly by the object. This is the
smallest class with that shape, shared by the reference scheduler (``kv-lifecycle simulate``),
the tests and the benchmarks. KV exists for ``origin_input_ids + output_ids[:-1]``: the last
sampled token has no KV yet.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVState:
    """The request's KV bookkeeping, as SGLang keeps it (``req.kv``).

    Attributes:
        req_pool_idx: the request's row in the req-to-token pool (None: no row).
        kv_committed_len: tokens whose KV is written (positions ``[0, committed)``).
        kv_allocated_len: slots listed in the row (``>= committed``; more with speculative decoding).
    """

    __slots__ = ("req_pool_idx", "kv_committed_len", "kv_allocated_len")

    def __init__(self, row: int | None = None, committed: int = 0, allocated: int | None = None) -> None:
        self.req_pool_idx = row
        self.kv_committed_len = committed
        self.kv_allocated_len = committed if allocated is None else allocated

    def __repr__(self) -> str:
        return (f"KVState(row={self.req_pool_idx}, committed={self.kv_committed_len}, "
                f"allocated={self.kv_allocated_len})")


class Request:
    """A decode request.

    Args:
        rid: the request id (any hashable; SGLang uses a string).
        prompt: the prompt's token ids (``origin_input_ids``).
        row: its req-to-token row, or None before admission.
        outputs: tokens sampled so far (``output_ids``); the prefill node samples the first.
        spec: speculative slots kept beyond the committed KV (``allocated = committed + spec``).
        finished: whether ``finished()`` already says so.
        extra_key: SGLang's ``Req.extra_key`` (a LoRA request's ends with its adapter id), or None.
        cache_salt: the tenant's cache salt, or None. With ``extra_key`` it names the namespace the
            request's pages are stored under (``DecodeOffloadManager.namespace_of``).
    """

    __slots__ = ("rid", "origin_input_ids", "output_ids", "kv", "spec", "_finished", "extra_key", "cache_salt",
                 "__weakref__")

    def __init__(self, rid, prompt: Iterable[int], row: int | None = None, *,
                 outputs: Iterable[int] = (), spec: int = 0, finished: bool = False,
                 extra_key: str | None = None, cache_salt: str | None = None) -> None:
        self.rid = rid
        self.extra_key, self.cache_salt = extra_key, cache_salt
        self.origin_input_ids = list(prompt)
        self.output_ids = list(outputs)
        committed = len(self.origin_input_ids) + max(len(self.output_ids) - 1, 0)
        self.kv = KVState(row, committed, committed + spec)
        self.spec = spec
        self._finished = finished

    def finished(self) -> bool:
        """True once the request is done (finished, aborted or retracted)."""
        return self._finished

    def finish(self) -> None:
        """Mark the request done."""
        self._finished = True

    def decode(self, token: int) -> None:
        """One decode step: the last token's KV is written and ``token`` is sampled."""
        self.kv.kv_committed_len += 1
        self.kv.kv_allocated_len = self.kv.kv_committed_len + self.spec
        self.output_ids.append(token)

    def __repr__(self) -> str:
        return f"Request({self.rid!r}, prompt={len(self.origin_input_ids)}, outputs={len(self.output_ids)}, {self.kv})"
