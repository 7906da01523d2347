"""Which SGLang release the drop-in runs against, and the one place where that is checked.

The drop-in is tested with SGLang 0.5.19 and 0.5.23 (``TESTED``); ``install()`` and every
construction read the release and refuse any other in one line, unless
``KV_LIFECYCLE_SGLANG_UNTESTED_OK=1`` (someone testing a new release: it then runs with the
differences of the nearest tested release at or below it, else the oldest).

Where the release is read from (``release_of``): the runtime context's ``sglang_version`` when it
declares one (``use_runtime`` with a context standing for a given release: the test doubles
declare 0.5.19, whose classes they imitate), else the installed ``sglang`` distribution
(``importlib.metadata``). With neither (no sglang installed, nothing declared) there is no release
to check: the drop-in runs over SGLang-shaped objects with 0.5.19's differences.

What differs between the tested releases, and where the drop-in follows it (``Release``):

* releasing a finished request (``release.SGLangReleaseSink``): 0.5.19 frees the row's committed
  range and any speculative tail and takes ``len(req.prefix_indices)`` off
  ``tree_cache.protected_size_``; 0.5.23 frees ``[kv.cache_protected_len, kv.kv_allocated_len)``
  (the prefix matched from the tree stays the tree's), then ``tree_cache.unlock(req.lock)``.
* the file backend's directory: 0.5.23 also reads the extra-config key ``file_storage_path``
  (after ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``).
* 0.5.23's scheduler calls ``drain_before_retraction()`` before it retracts decode requests, and
  its unified-memory move gate ``has_inflight_device_transfer()``; the drop-in has both always.
* hybrid sliding-window pools (``UnifiedSWAKVPool``, which 0.5.23's own manager offloads) are
  refused at construction on every release (``device_pool.check_pool_kind``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from lifecycle.integrations.sglang.errors import SGLangConfigError

TESTED = ("0.5.19", "0.5.23")
UNTESTED_OK_ENV = "KV_LIFECYCLE_SGLANG_UNTESTED_OK"
DISTRIBUTION = "sglang"


@dataclass(frozen=True)
class Release:
    """The SGLang release in force and the tested release whose differences apply.

    Attributes:
        version: what was read (``"0.5.23"``, ``"0.5.24rc1"``, ...); None when there is none.
        behaves_as: one of ``TESTED``: the differences the drop-in follows.
        source: where ``version`` came from (for messages).
    """

    version: str | None
    behaves_as: str
    source: str

    @property
    def releases_through_tree_lock(self) -> bool:
        """0.5.23's release: free ``[cache_protected_len, kv_allocated_len)`` then
        ``tree_cache.unlock(req.lock)``; else 0.5.19's (committed range, ``protected_size_``)."""
        return self.behaves_as == "0.5.23"

    @property
    def file_storage_path_key(self) -> bool:
        """Whether HiCacheFile reads the extra-config key ``file_storage_path`` (0.5.23)."""
        return self.behaves_as == "0.5.23"


def installed_version() -> str | None:
    """The installed ``sglang`` distribution's version, or None when it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def _numbers(version: str) -> tuple[int, ...] | None:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return tuple(parts) if parts else None
        parts.append(int(digits))
        if digits != piece:  # 0.5.24rc1: the pre-release tail ends the release numbers
            break
    return tuple(parts)


def nearest_tested(version: str) -> str:
    """The newest tested release at or below ``version``, else the oldest tested one."""
    numbers = _numbers(version)
    if numbers is None:
        return TESTED[0]
    below = [t for t in TESTED if _numbers(t) <= numbers]
    return below[-1] if below else TESTED[0]


def check(version: str | None, source: str, environ: Mapping[str, str] | None = None) -> Release:
    """The ``Release`` for ``version`` read from ``source``.

    Raises:
        SGLangConfigError: ``version`` is not one of ``TESTED`` and ``KV_LIFECYCLE_SGLANG_UNTESTED_OK``
            is not ``1`` (one line naming the release, the tested ones and how to force it).
    """
    if version is None:
        return Release(None, TESTED[0], source)
    base = version.split("+")[0]
    if base in TESTED:
        return Release(version, base, source)
    env = os.environ if environ is None else environ
    if env.get(UNTESTED_OK_ENV) == "1":
        return Release(version, nearest_tested(version), source)
    raise SGLangConfigError(
        f"SGLang {version} ({source}) is not a release kv-lifecycle's drop-in is tested with "
        f"({', '.join(TESTED)}); to run it anyway, set {UNTESTED_OK_ENV}=1")


def release_of(context=None, environ: Mapping[str, str] | None = None) -> Release:
    """The release the drop-in runs against: ``context.sglang_version`` when the runtime context
    declares it, else the installed sglang's (see the module docstring), checked by ``check``.

    Raises:
        SGLangConfigError: an untested release, not forced (see ``check``); a declared
            ``sglang_version`` that is not a non-empty str.
    """
    declared = getattr(context, "sglang_version", None) if context is not None else None
    if declared is not None:
        if not isinstance(declared, str) or not declared:
            raise SGLangConfigError(f"runtime context sglang_version must be a non-empty str, got {declared!r}")
        return check(declared, "declared by the runtime context", environ)
    return check(installed_version(), "the installed sglang", environ)


__all__ = ["TESTED", "UNTESTED_OK_ENV", "Release", "check", "installed_version", "nearest_tested", "release_of"]
