"""SGLang 0.5.23's ``HiCacheController._generate_storage_config``, copied verbatim for tests.

The return statement of ``sglang/srt/managers/cache_controller.py`` (``sglang-0.5.23``), with its
inputs given as arguments (``get_parallel()``'s fields, ``self.*``) and the installed SGLang's
``HiCacheStorageConfig`` (it runs only where sglang 0.5.23 imports). The copied lines are marked
``# --- verbatim`` / ``# --- end``. Differences from 0.5.19's (``tests/data/sglang_0_5_19.py``):
``dp_rank`` (the attention-DP rank, 0 without DP attention), ``dcp_size`` / ``dcp_rank`` /
``logical_page_size`` (decode context parallelism, which the drop-in refuses), and the model name
tagged with the host pool's ``storage_format_tag`` (None for the MHA / MLA host pools).
"""

from __future__ import annotations


def storage_config_from_controller(*, tp_rank, tp_size, pp_rank, pp_size, attn_cp_group_rank_size, is_mla,
                                   layout, model_name, extra_config, dp_rank=0, dcp_size=1, dcp_rank=0,
                                   page_size=None, storage_format_tag=None):
    """``HiCacheController._generate_storage_config`` of 0.5.23 with its inputs given; ``parallel``
    is ``get_parallel()`` (``pp_rank``, ``pp_size``), ``attn_cp_group_rank_size`` is
    ``get_attn_cp_rank_and_size()`` — ``(0, 1)`` when no attention-CP group is passed."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    parallel = SimpleNamespace(pp_rank=pp_rank, pp_size=pp_size)
    attn_cp_rank, attn_cp_size = attn_cp_group_rank_size
    storage_backend_extra_config = dict(extra_config or {})
    tp_lcm_size = storage_backend_extra_config.pop("tp_lcm_size", None)
    should_split_heads = False
    is_rank_replicated = is_mla
    self = SimpleNamespace(page_size=page_size, enable_storage_metrics=False,
                           mem_pool_host=SimpleNamespace(layout=layout))
    # storage_model_name(model_name, self.storage_host_pool)
    model_name = model_name if storage_format_tag is None else (
        f"{model_name}-{storage_format_tag}" if model_name else storage_format_tag)
    # --- verbatim
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=parallel.pp_rank,
        pp_size=parallel.pp_size,
        attn_cp_rank=attn_cp_rank,
        attn_cp_size=attn_cp_size,
        # TODO(hzh): Rename is_mla_model to is_rank_replicated.
        is_mla_model=is_rank_replicated,
        enable_storage_metrics=self.enable_storage_metrics,
        is_page_first_layout=self.mem_pool_host.layout == "page_first",
        model_name=model_name,
        tp_lcm_size=tp_lcm_size,
        should_split_heads=should_split_heads,
        dp_rank=dp_rank,
        extra_config=storage_backend_extra_config,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        logical_page_size=self.page_size if dcp_size > 1 else None,
    )
    # --- end
