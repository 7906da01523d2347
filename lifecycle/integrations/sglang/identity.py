"""The deployment identity of an SGLang decode node, as SGLang 0.5.19 names its storage.

``DecodeKVCacheOffloadManager`` builds its ``HiCacheController`` with the served model name and
the backend extra config, and no attention-CP group; ``HiCacheController._generate_storage_config``
then gives the storage backend: the TP rank and size (the attention-TP ones under DP attention,
which the caller passes here), the PP rank and size, attention-CP rank 0 of 1, ``is_mla_model``,
and the extra config whose ``extra_backend_tag`` Mooncake puts in front of every object name. The
host pool's layout is ``--hicache-mem-layout`` as SGLang resolved it.
"""

from __future__ import annotations

from transfer.errors import StorageConfigError
from transfer.storage.identity import DeploymentIdentity

from lifecycle.integrations.sglang.config import OffloadConfig
from lifecycle.integrations.sglang.errors import SGLangConfigError


def deployment_identity(config: OffloadConfig, tp_rank: int, tp_size: int, mla: bool) -> DeploymentIdentity:
    """The identity every tier names this rank's pages from, as SGLang's storage config does.

    Args:
        config: the checked SGLang configuration (``read_config``).
        tp_rank, tp_size: this rank's (attention-)TP place.
        mla: the device pool is an MLA pool (SGLang's ``is_mla_model``).
    Returns:
        The ``DeploymentIdentity``: model ``served_model_name``, tag ``extra_backend_tag`` (as
        ``str``, like SGLang), TP and PP places, attention CP 0 of 1 (the decode offload manager
        passes SGLang no CP group), ``mla``, layout ``hicache_mem_layout``.
    Raises:
        SGLangConfigError: a deployment no tier can name or lay out as SGLang does (one line),
            including SGLang's split-heads naming (``tp_lcm_size`` > ``tp_size`` in ``page_head``).
    """
    extra = config.extra_config or {}
    tag = extra.get("extra_backend_tag")
    lcm = extra.get("tp_lcm_size")
    if lcm and not mla and config.mem_layout == "page_head" and isinstance(lcm, int) and lcm > tp_size:
        # SGLang then splits each page's heads over tp_lcm_size // tp_size objects per rank
        # (should_split_heads), names no single page object, and needs every rank's split to read one
        raise SGLangConfigError(
            f"storage naming: tp_lcm_size {lcm} > tp_size {tp_size} with page_head splits pages by heads "
            "(SGLang's heterogeneous-TP objects); kv-lifecycle stores whole pages — drop tp_lcm_size")
    try:
        return DeploymentIdentity(model_name=config.model_name, backend_tag=None if tag is None else str(tag),
                                  tp_rank=tp_rank, tp_size=tp_size, pp_rank=config.pp_rank, pp_size=config.pp_size,
                                  attn_cp_rank=0, attn_cp_size=1, mla=mla, layout=config.mem_layout)
    except StorageConfigError as err:
        raise SGLangConfigError(f"storage naming: {err}") from None
