"""Open a storage backend from a one-line spec: ``memory``, ``file:DIR``, ``redis://host:port/db``,
``redis+cluster://...``, ``mooncake://...``, named for one deployment identity.

Every tier gets the same ``DeploymentIdentity`` (``transfer.storage.identity``) and derives its
names from it: the file and memory suffix, the Redis keys, the Mooncake object names. A
``mooncake://`` URL may set identity fields as options (``model``, ``backend_tag``, ``tp_rank``,
``tp_size``, ``pp_rank``, ``pp_size``, ``attn_cp_rank``, ``attn_cp_size``, ``mla``, ``layout``); they
override the identity the caller passes. A host layout other than ``page_first`` stores the
pages in that layout's byte order (``transfer.storage.layout.LayoutStorage``).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from transfer.errors import StorageConfigError
from transfer.storage.base import Storage
from transfer.storage.identity import IDENTITY_OPTIONS, PAGE_FIRST, DeploymentIdentity, identity_changes
from transfer.storage.checks import check_sizes, check_ttl
from transfer.storage.integrity import PageFormat
from transfer.storage.retention import merge, split_retention_options

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


def is_redis_spec(spec: str) -> bool:
    """Whether ``spec`` names a Redis/Valkey server."""
    return isinstance(spec, str) and spec.startswith(REDIS_SCHEMES)


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://", "valkey+cluster://", "valkeys+cluster://")


def is_server_spec(spec: str) -> bool:
    """Whether ``spec`` names a storage server ``open_storage`` knows: Redis/Valkey, a Redis
    Cluster (``redis+cluster://``) or a Mooncake master (``mooncake://``)."""
    return is_redis_spec(spec) or (isinstance(spec, str) and spec.startswith(CLUSTER_SCHEMES + ("mooncake://",)))


def split_identity_options(spec: str) -> tuple[str, dict]:
    """``(spec without identity options, identity field changes)`` for a ``mooncake://`` URL; any
    other spec is returned as it is, with no changes.

    Raises:
        StorageConfigError: an identity option given twice or of the wrong type.
    """
    if not (isinstance(spec, str) and spec.startswith("mooncake://")):
        return spec, {}
    parts = urlsplit(spec)
    kept, options = [], {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in IDENTITY_OPTIONS:
            if name in options:
                raise StorageConfigError(f"storage option {name} given twice in {spec!r}")
            options[name] = value
        else:
            kept.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), identity_changes(options)


def resolve_identity(spec: str, suffix: str, identity: DeploymentIdentity | None,
                     page_format: PageFormat | None) -> tuple[str, DeploymentIdentity | None]:
    """``(spec without identity options, the identity the tier is named for)``.

    The identity is ``identity`` with the URL's identity options applied; None when neither is
    given (a tier then names pages ``{hash}{suffix}`` and, for Mooncake, refuses to open).

    Raises:
        StorageConfigError: ``suffix`` is not the identity's file suffix; a bad option or field.
    """
    spec, changes = split_identity_options(spec)
    if changes:
        if identity is None:
            mla = page_format is not None and len(page_format.shape) == 4
            identity = DeploymentIdentity(mla=mla)
        identity = identity.replace(**changes)
    if identity is not None and suffix and suffix != identity.file_suffix:
        raise StorageConfigError(
            f"storage suffix {suffix!r} is not the deployment identity's {identity.file_suffix!r} "
            f"({identity.describe()}); pass one of them")
    return spec, identity


def open_storage(
    spec: str,
    suffix: str = "",
    page_nbytes: int | None = None,
    *,
    identity: DeploymentIdentity | None = None,
    capacity_bytes: int | None = None,
    ttl_s: float | None = None,
    key_prefix: str = "",
    page_format: PageFormat | None = None,
    require_checksum: bool = False,
    connect_timeout_s: float = 0.5,
) -> Storage:
    """The backend ``spec`` names, naming pages for ``identity``.

    Args:
        spec: ``"memory"``, ``"file:DIR"`` (``~`` expanded), or a server URL ``redis://host:port/db``
            (also ``rediss://``, ``unix://path?db=N``; ``valkey://`` is an alias of ``redis://``),
            or ``redis+cluster://HOST:PORT`` (any node of a Redis/Valkey Cluster), or
            ``mooncake://HOST:PORT?options`` (a Mooncake master; see ``transfer.storage.mooncake.conn``; identity
            options as in the module docstring).
        suffix: a literal deployment suffix for a store opened without an identity (file, Redis,
            memory: ``{hash}{suffix}``); with an identity it must be '' or the identity's.
        page_nbytes: the page size (see ``Storage``).
        identity: the deployment identity every name derives from (None: ``suffix`` only; a
            Mooncake tier then needs identity options in its URL or is refused).
        capacity_bytes: LRU bound (None: unbounded).
        ttl_s: page expiry for a server backend (ignored by the others).
        key_prefix: prepended to every Redis / Redis Cluster key (ignored by the others).
            ``capacity_bytes``, ``ttl_s`` and ``key_prefix`` may also be query options of ``spec``
            (``transfer.storage.retention``: ``redis://h:6379/0?ttl_s=3600&key_prefix=kv:``,
            ``file:DIR?capacity_bytes=N``); an option in both places with different values is an error.
        page_format: what the pages are (layout, dtype, shape), sealed with every page and checked
            on read by every backend (None: each page's own dtype and shape, layout ``raw``). With
            an identity whose layout is not ``page_first``, the page-first host pages this
            describes are stored in the identity's layout (``LayoutStorage``).
        require_checksum: strict mode (memory, file, Mooncake): a page without a seal is a miss.
        connect_timeout_s: how long to wait for a server to accept the connection.
    Raises:
        ValueError: an unknown spec. StorageConfigError (a ValueError): a bad URL (e.g. a
            non-numeric database), suffix, identity or format; a deployment a tier cannot name the
            way SGLang does (one line); a ``ttl_s`` out of range, a ``page_nbytes`` or
            ``capacity_bytes`` that is not a positive int (any tier, before anything is opened).
        StorageUnavailable: the directory is not writable, or the server does not answer (a
            one-line message naming the URL and the reason).
    """
    spec, retention = split_retention_options(spec)
    capacity_bytes = merge("capacity_bytes", retention, capacity_bytes)
    ttl_s, key_prefix = merge("ttl_s", retention, ttl_s), merge("key_prefix", retention, key_prefix)
    check_ttl(ttl_s)  # every tier: a bad expiry or bound is refused even where it is not used
    check_sizes(page_nbytes=page_nbytes, capacity_bytes=capacity_bytes)
    spec, identity = resolve_identity(spec, suffix, identity, page_format)
    if identity is not None:
        suffix = identity.file_suffix
        if page_format is not None and (len(page_format.shape) == 4) != identity.mla:
            raise StorageConfigError(
                f"page format {page_format} is {'an MLA' if len(page_format.shape) == 4 else 'an MHA'} page, "
                f"the deployment identity says mla={identity.mla}")
    if identity is None or identity.layout == PAGE_FIRST:
        return _open(spec, suffix, page_nbytes, identity, capacity_bytes, ttl_s, key_prefix, page_format,
                     require_checksum, connect_timeout_s)
    from transfer.storage.layout import stored_in_layout

    if page_format is None:
        raise StorageConfigError(f"host layout {identity.layout} needs the page format (dtype, shape) to order "
                                 "the bytes; pass page_format")
    return stored_in_layout(lambda fmt: _open(spec, suffix, page_nbytes, identity, capacity_bytes, ttl_s, key_prefix, fmt,
                                              require_checksum, connect_timeout_s), identity.layout, page_format)


def _open(spec, suffix, page_nbytes, identity, capacity_bytes, ttl_s, key_prefix, page_format, require_checksum,
          connect_timeout_s) -> Storage:
    if spec == "memory":
        from transfer.storage.memory import MemoryStorage

        return MemoryStorage(suffix, page_nbytes, capacity_bytes, page_format=page_format,
                             require_checksum=require_checksum)
    if isinstance(spec, str) and spec.startswith("file:") and len(spec) > 5:
        from transfer.storage.file import FileStorage

        return FileStorage(os.path.expanduser(spec[5:]), suffix, page_nbytes, capacity_bytes,
                           require_checksum=require_checksum, page_format=page_format)
    if is_redis_spec(spec):
        from transfer.storage.redis.store import RedisStorage

        url = "redis://" + spec[len("valkey://"):] if spec.startswith("valkey://") else spec
        url = "rediss://" + spec[len("valkeys://"):] if spec.startswith("valkeys://") else url
        return RedisStorage(url, suffix, page_nbytes, ttl_s, capacity_bytes=capacity_bytes,
                            page_format=page_format, connect_timeout_s=connect_timeout_s,
                            key_prefix=key_prefix + (identity.redis_key_prefix if identity is not None else ""))
    if isinstance(spec, str) and spec.startswith(CLUSTER_SCHEMES):
        from transfer.storage.redis.cluster import RedisClusterStorage

        return RedisClusterStorage(spec, suffix, page_nbytes, ttl_s, capacity_bytes=capacity_bytes,
                                   page_format=page_format, connect_timeout_s=connect_timeout_s,
                                   key_prefix=key_prefix + (identity.redis_key_prefix if identity is not None else ""))
    if isinstance(spec, str) and spec.startswith("mooncake://"):
        from transfer.storage.mooncake.store import MooncakeStorage
        from transfer.storage.mooncake.conn import parse_spec

        if identity is None and suffix:
            raise StorageConfigError(
                f"a Mooncake tier names pages from the deployment identity, not a suffix string ({suffix!r}); "
                "pass identity= (build_stack does) or identity options in the URL")
        return MooncakeStorage(parse_spec(spec), page_nbytes=page_nbytes, identity=identity,
                               page_format=page_format, require_checksum=require_checksum)
    raise ValueError(f"storage must be 'memory', 'file:DIR', 'redis://HOST:PORT/DB', 'redis+cluster://HOST:PORT', "
                     f"'mooncake://HOST:PORT' or a Storage, got {spec!r}")
