"""Where the integration reads SGLang's configuration from: SGLang's runtime context.

SGLang's ``DecodeKVCacheOffloadManager`` (0.5.19, 0.5.23) reads ``get_schedule()``, ``get_memory()`` and
``get_serving()`` from ``sglang.srt.runtime_context``; so does this integration (plus
``get_parallel()`` for the pipeline rank, which SGLang's storage naming reads too). The module is
imported only when a manager is constructed. ``use_runtime`` substitutes another object with the
same four getters (tests, or an embedding without SGLang's published context).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Protocol

from lifecycle.integrations.sglang.errors import SGLangConfigError

GETTERS = ("get_schedule", "get_memory", "get_serving", "get_parallel")

_lock = threading.Lock()
_override: list = []


class RuntimeContext(Protocol):
    """The part of ``sglang.srt.runtime_context`` the integration reads."""

    def get_schedule(self): ...   # .page_size
    def get_memory(self): ...     # .hicache_* settings
    def get_serving(self): ...    # .served_model_name
    def get_parallel(self): ...   # .pp_rank, .pp_size, .dcp_enabled


def current():
    """The runtime context in force: the innermost ``use_runtime``, else SGLang's own module.

    Raises:
        SGLangConfigError: no override and ``sglang.srt.runtime_context`` cannot be imported.
    """
    with _lock:
        if _override:
            return _override[-1]
    try:
        from sglang.srt import runtime_context  # noqa: PLC0415 (lazy: sglang is optional)
    except ImportError as err:
        raise SGLangConfigError(
            f"sglang.srt.runtime_context cannot be imported ({err}); run inside SGLang (0.5.19, 0.5.23), "
            "or supply the getters with lifecycle.integrations.sglang.use_runtime(...)"
        ) from err
    return runtime_context


@contextmanager
def use_runtime(context) -> Iterator[None]:
    """Read configuration from ``context`` (an object with ``get_schedule``, ``get_memory``,
    ``get_serving`` and ``get_parallel``) while the block runs; nestable.

    Raises:
        SGLangConfigError: ``context`` lacks one of the getters (nothing changes).
    """
    missing = [g for g in GETTERS if not callable(getattr(context, g, None))]
    if missing:
        raise SGLangConfigError(f"runtime context {context!r} lacks {', '.join(missing)}")
    with _lock:
        _override.append(context)
    try:
        yield
    finally:
        with _lock:
            _override.remove(context)
