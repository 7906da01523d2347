"""SGLang 0.5.19's Mooncake object names, so SGLang nodes and ours share pages in one store.

SGLang's ``MooncakeStore`` (``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``)
names the objects of page ``hash`` as follows (``batch_set_v1`` / ``batch_get_v1`` /
``batch_exists``):

* prefix: ``config_prefix = "_".join([extra_backend_tag, model_name.replace("/", "-")])`` over
  the parts that are set; the page's base name is ``f"{config_prefix}_{hash}"`` (``_tag_keys``),
  or the bare hash when neither is set;
* MHA: two objects, ``f"{base}_{mha_suffix}_k"`` and ``f"{base}_{mha_suffix}_v"`` where
  ``mha_suffix`` is ``f"{tp_rank}"``, or ``f"{tp_rank}_{pp_rank}"`` when ``pp_size > 1``;
* MLA: one object ``f"{base}_{mla_suffix}_k"`` where ``mla_suffix`` is ``""`` (so ``{base}__k``),
  or ``f"{pp_rank}"`` when ``pp_size > 1``.

Each object holds all layers of the page for its half: with SGLang's ``page_first`` host layout
(its default), ``get_page_buffer_meta`` points K at ``[page_size, layers, heads, head_dim]`` of
the page and V likewise — exactly the first and second half of our page bytes
(``[2, page_size, layers, heads, head_dim]``), so an MHA page is two zero-copy slices of one host
page. MLA's object is the whole page ``[page_size, layers, 1, width]``.

Our only addition is one small object per page, ``f"{base}_{rank_suffix}_kvlp"`` (the seal; see
``transfer.storage.mooncake.store``), which SGLang never reads: ``_kvlp`` is not a suffix SGLang uses.

The naming is built from the deployment identity (``MooncakeNaming.of``), never parsed back from a
suffix string. SGLang leaves the attention context-parallel rank out of its object names, so CP
ranks share names (first writer wins, as in SGLang); our seal binds the CP rank into the name it
verifies (``page_name``), so a CP rank never serves a page another CP rank wrote. Other host layouts
(``page_first_direct``, ``page_head``) keep the same names and change the bytes of each block
(``transfer.storage.layout``).
"""

from __future__ import annotations

import msgspec

from transfer.errors import StorageConfigError
from transfer.storage.identity import DeploymentIdentity

SEAL_SUFFIX = "kvlp"


class MooncakeNaming(msgspec.Struct, frozen=True):
    """Who the pages belong to, as SGLang's Mooncake backend names them.

    Args:
        model_name: SGLang's ``served_model_name`` ('' for none); ``/`` becomes ``-``.
        tp_rank, pp_rank, pp_size: this rank's place (``pp_size > 1`` adds ``pp_rank``).
        mla: one latent object per page instead of K and V.
        backend_tag: SGLang's ``extra_backend_tag`` (None: not set).
        attn_cp_rank, attn_cp_size: not in the object names (SGLang leaves them out); bound into
            the name the seal verifies when ``attn_cp_size > 1``.
    """

    model_name: str = ""
    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    mla: bool = False
    backend_tag: str | None = None
    attn_cp_rank: int = 0
    attn_cp_size: int = 1

    @classmethod
    def of(cls, identity: DeploymentIdentity) -> "MooncakeNaming":
        """SGLang's ``MooncakeStore`` naming for ``identity`` (its ``HiCacheStorageConfig`` fields
        ``model_name``, ``tp_rank``, ``pp_rank``, ``pp_size``, ``is_mla_model`` and the
        ``extra_backend_tag`` of its extra config)."""
        return cls(model_name=identity.model_name, tp_rank=identity.tp_rank, pp_rank=identity.pp_rank,
                   pp_size=identity.pp_size, mla=identity.mla, backend_tag=identity.backend_tag,
                   attn_cp_rank=identity.attn_cp_rank, attn_cp_size=identity.attn_cp_size)

    def __post_init__(self) -> None:
        if self.tp_rank < 0 or self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size \
                or self.attn_cp_size < 1 or not 0 <= self.attn_cp_rank < self.attn_cp_size:
            raise StorageConfigError(
                f"bad ranks: tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, pp_size={self.pp_size}, "
                f"attn_cp_rank={self.attn_cp_rank}, attn_cp_size={self.attn_cp_size}")
        for text in (self.model_name, self.backend_tag or ""):
            if any(c.isspace() or ord(c) < 32 for c in text):
                raise StorageConfigError(f"model name / backend tag must not hold whitespace: {text!r}")

    @property
    def prefix(self) -> str | None:
        """SGLang's ``config_prefix`` (None when neither a tag nor a model name is set)."""
        parts = [str(self.backend_tag)] if self.backend_tag is not None else []
        if self.model_name:
            parts.append("-".join(self.model_name.split("/")))
        return "_".join(parts) if parts else None

    @property
    def rank_suffix(self) -> str:
        """SGLang's ``mha_suffix`` (MHA) or ``mla_suffix`` (MLA)."""
        if self.mla:
            return f"{self.pp_rank}" if self.pp_size > 1 else ""
        return f"{self.tp_rank}_{self.pp_rank}" if self.pp_size > 1 else f"{self.tp_rank}"

    @property
    def kinds(self) -> int:
        """Objects per page: 2 (K, V) for MHA, 1 for MLA."""
        return 1 if self.mla else 2

    def base(self, page_hash: str) -> str:
        """The page's tagged key (SGLang's ``_tag_keys``)."""
        prefix = self.prefix
        return page_hash if prefix is None else f"{prefix}_{page_hash}"

    def object_base(self, page_hash: str) -> str:
        """What every object name of the page starts with: ``{base}_{rank_suffix}``."""
        return f"{self.base(page_hash)}_{self.rank_suffix}"

    def page_name(self, page_hash: str) -> str:
        """The page's name bound into its seal: ``object_base``, then ``_cp{rank}_{size}`` under
        attention context parallelism (each CP rank's page is its own)."""
        name = self.object_base(page_hash)
        return f"{name}_cp{self.attn_cp_rank}_{self.attn_cp_size}" if self.attn_cp_size > 1 else name

    def objects(self, page_hash: str) -> list[str]:
        """The object names holding the page's bytes, in byte order (K then V; MLA: one)."""
        name = self.object_base(page_hash)
        return [f"{name}_k"] if self.mla else [f"{name}_k", f"{name}_v"]

    def seal_object(self, page_hash: str) -> str:
        """The name of the page's seal object (shared by CP ranks, like the page's objects)."""
        return f"{self.object_base(page_hash)}_{SEAL_SUFFIX}"

