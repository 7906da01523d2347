"""Who a node's pages belong to: one deployment identity, built once, handed to every tier.

Every name a tier stores a page under is a function of this value, never parsed back from a
string: the file suffix (SGLang 0.5.19 ``HiCacheFile.config_suffix``), the Mooncake object names
(SGLang's ``MooncakeStore``; ``transfer.storage.mooncake.keys.MooncakeNaming.of``) and the Redis
keys. The host layout says in which byte order a page is written (``transfer.storage.layout``) and
is recorded in every page's seal, so a reader of another layout refuses it.

A deployment that SGLang itself cannot name or lay out — an MLA model in the ``page_head`` host
layout (SGLang's MLA host pool has none), a layout SGLang's storage backends do not write
(``layer_first``) — is refused here, in one line, before any tier opens.
"""

from __future__ import annotations

import msgspec

import hashing
from transfer.errors import StorageConfigError
from transfer.storage.integrity import check_suffix

PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD = "page_first", "page_first_direct", "page_head"
LAYOUTS = (PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD)
MLA_LAYOUTS = (PAGE_FIRST, PAGE_FIRST_DIRECT)


class DeploymentIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment's (and one rank's) identity in shared storage.

    Args:
        model_name: SGLang's ``served_model_name`` ('' for none); ``/`` becomes ``-`` in names.
        backend_tag: SGLang's ``extra_backend_tag`` (Mooncake's tenant prefix; None: not set).
            HiCacheFile ignores it, and so do our file names; Redis keys start with ``{tag}_``.
        tp_rank, tp_size: tensor-parallel place (SGLang's attention-TP place under DP attention).
        pp_rank, pp_size: pipeline-parallel place.
        attn_cp_rank, attn_cp_size: attention context-parallel place.
        mla: latent-only KV (the same on every TP rank).
        layout: the host layout the page bytes are ordered in: ``page_first`` (SGLang's default),
            ``page_first_direct`` (what ``--hicache-io-backend direct`` resolves to) or
            ``page_head``.
    Raises:
        StorageConfigError (a ValueError): a rank outside ``0..size-1``, a size < 1, a non-int,
            a name with whitespace or control characters, an unknown layout, or a combination
            SGLang cannot lay out (MLA in ``page_head``) — one line naming the field.
    """

    model_name: str = ""
    backend_tag: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    mla: bool = False
    layout: str = PAGE_FIRST

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str):
            raise StorageConfigError(f"deployment identity: model_name must be a str, got {self.model_name!r}")
        for what, text in (("model_name", self.model_name), ("backend_tag", self.backend_tag)):
            if text is None:
                continue
            if not isinstance(text, str) or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
                raise StorageConfigError(
                    f"deployment identity: {what} must be a str without whitespace or control characters, "
                    f"got {text!r:.90}")
        if self.backend_tag == "":
            raise StorageConfigError("deployment identity: backend_tag must be None or a non-empty str")
        for what, rank, size in (("tp", self.tp_rank, self.tp_size), ("pp", self.pp_rank, self.pp_size),
                                 ("attn_cp", self.attn_cp_rank, self.attn_cp_size)):
            if type(rank) is not int or type(size) is not int or size < 1 or not 0 <= rank < size:
                raise StorageConfigError(
                    f"deployment identity: {what}_rank {rank!r} is not in 0..{what}_size-1 ({what}_size {size!r})")
        if type(self.mla) is not bool:
            raise StorageConfigError(f"deployment identity: mla must be a bool, got {self.mla!r}")
        if self.layout not in LAYOUTS:
            raise StorageConfigError(
                f"deployment identity: host layout {self.layout!r} is not one SGLang's storage backends write; "
                f"supported: {', '.join(LAYOUTS)}")
        if self.mla and self.layout not in MLA_LAYOUTS:
            raise StorageConfigError(
                f"deployment identity: an MLA model cannot use host layout {self.layout!r} (SGLang's "
                f"MLATokenToKVPoolHost has none); supported for MLA: {', '.join(MLA_LAYOUTS)}")
        check_suffix(self.file_suffix)

    @property
    def file_suffix(self) -> str:
        """SGLang 0.5.19 ``HiCacheFile.config_suffix``: the file store's ``{hash}{suffix}.bin`` and
        the suffix of Redis and memory keys (``hashing.storage_suffix``)."""
        return hashing.storage_suffix(self.model_name, self.tp_rank, self.tp_size, is_mla=self.mla,
                                      pp_rank=self.pp_rank, pp_size=self.pp_size,
                                      attn_cp_rank=self.attn_cp_rank, attn_cp_size=self.attn_cp_size)

    @property
    def redis_key_prefix(self) -> str:
        """What a Redis key starts with: ``{backend_tag}_`` when a tag is set, else nothing."""
        return f"{self.backend_tag}_" if self.backend_tag is not None else ""

    def redis_key(self, page_hash: str) -> str:
        """The Redis (and Redis Cluster) key of ``page_hash``: ``{tag_}{hash}{file_suffix}``."""
        return f"{self.redis_key_prefix}{page_hash}{self.file_suffix}"

    def file_name(self, page_hash: str) -> str:
        """The file store's (and HiCacheFile's) file name of ``page_hash``."""
        return f"{page_hash}{self.file_suffix}.bin"

    def replace(self, **changes) -> "DeploymentIdentity":
        """A copy with ``changes`` applied (checked again)."""
        return msgspec.structs.replace(self, **changes)

    def describe(self) -> str:
        """One line for messages: ``model=... tp=0/1 pp=0/1 cp=0/1 mla=False layout=page_first``."""
        tag = f" tag={self.backend_tag}" if self.backend_tag is not None else ""
        return (f"model={self.model_name!r}{tag} tp={self.tp_rank}/{self.tp_size} pp={self.pp_rank}/{self.pp_size} "
                f"cp={self.attn_cp_rank}/{self.attn_cp_size} mla={self.mla} layout={self.layout}")


IDENTITY_OPTIONS = ("model", "backend_tag", "tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank",
                    "attn_cp_size", "mla", "layout")
_FIELD = {"model": "model_name"}
_INTS = {"tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size"}
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def identity_changes(options: dict[str, str]) -> dict:
    """Identity fields from URL query options (``model``, ``backend_tag``, ranks and sizes,
    ``mla``, ``layout``): ``{"tp_rank": "1"}`` -> ``{"tp_rank": 1}``.

    Raises:
        StorageConfigError: a value of the wrong type (``tp_rank=x``, ``mla=maybe``).
    """
    out: dict = {}
    for name, value in options.items():
        field = _FIELD.get(name, name)
        try:
            if name in _INTS:
                out[field] = int(value)
            elif name == "mla":
                out[field] = _BOOL[value.lower()]
            else:
                out[field] = value
        except (ValueError, KeyError):
            raise StorageConfigError(f"bad value for storage option {name}: {value!r}") from None
    return out
