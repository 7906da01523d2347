"""SGLang 0.5.19's storage naming and host-layout byte order, copied verbatim for tests.

SGLang cannot be imported in this test environment (it needs CUDA kernels and a whole server's
import chain), so the functions that decide what a page is called and which bytes it holds are
copied here from its source (``sglang-0.5.19``), with only the scaffolding needed to run them
(a ``HiCacheStorageConfig`` stand-in with its fields, ``self`` attributes set as its
constructors set them). The copied lines are marked ``# --- verbatim`` / ``# --- end``.

* ``HiCacheFile.__init__`` config suffix: ``sglang/srt/mem_cache/hicache_storage.py``
* ``MooncakeStore.__init__`` prefix and rank suffixes, ``_tag_keys``, ``_get_mha_buffer_meta`` /
  ``_get_mla_buffer_meta`` keys, ``batch_exists`` query keys:
  ``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``
* ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` ``init_kv_buffer`` dims, ``get_data_page``,
  ``set_from_flat_data_page``, ``get_page_buffer_meta``:
  ``sglang/srt/mem_cache/pool_host/mha.py``, ``sglang/srt/mem_cache/pool_host/mla.py``
* ``HiCacheController._generate_storage_config`` (which ranks reach the storage config):
  ``sglang/srt/managers/cache_controller.py``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class HiCacheStorageConfig:
    """``sglang/srt/mem_cache/hicache_storage.py`` (the dataclass, verbatim fields)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


class HiCacheFileNames:
    """What ``HiCacheFile`` names a page file."""

    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str = "/tmp/hicache"):
        self.file_path = file_path
        # --- verbatim HiCacheFile.__init__
        tp_rank, tp_size, pp_rank, pp_size, model_name, is_mla_model = (
            storage_config.tp_rank,
            storage_config.tp_size,
            storage_config.pp_rank,
            storage_config.pp_size,
            storage_config.model_name,
            storage_config.is_mla_model,
        )
        attn_cp_rank = storage_config.attn_cp_rank
        attn_cp_size = storage_config.attn_cp_size
        model_name = "-".join(model_name.split("/")) if model_name else ""
        enable_pp = pp_size > 1
        self.config_suffix = f"_{model_name}"
        if not is_mla_model:
            self.config_suffix += f"_{tp_rank}_{tp_size}"
        if enable_pp:
            self.config_suffix += f"_{pp_size}_{pp_rank}"
        # Under NSA context parallel each CP rank holds a disjoint slice of every
        # page, so give each rank its own file key to avoid a cross-rank write race.
        if attn_cp_size > 1:
            self.config_suffix += f"_cp{attn_cp_rank}_{attn_cp_size}"
        # --- end

    def _get_suffixed_key(self, key: str) -> str:
        # --- verbatim HiCacheFile._get_suffixed_key
        return key + self.config_suffix
        # --- end

    def file_name(self, key: str) -> str:
        """``HiCacheFile.set``: ``os.path.join(self.file_path, f"{key}.bin")`` of the suffixed key."""
        return f"{self._get_suffixed_key(key)}.bin"


class MooncakeStoreNames:
    """What ``MooncakeStore`` names a page's objects (``batch_set_v1`` / ``batch_get_v1`` /
    ``batch_exists``), without a client."""

    def __init__(self, storage_config: HiCacheStorageConfig = None):
        extra_config = (
            getattr(storage_config, "extra_config", None)
            if storage_config
            else None
        )
        # --- verbatim MooncakeStore.__init__ (prefix)
        # Use the backend tag and model name as a prefix to isolate tenants
        # and models sharing one store.
        self.config_prefix = None
        config_prefix_parts = []
        if extra_config and extra_config.get("extra_backend_tag") is not None:
            config_prefix_parts.append(str(extra_config["extra_backend_tag"]))
        if storage_config is not None and storage_config.model_name:
            model_name = "-".join(storage_config.model_name.split("/"))
            config_prefix_parts.append(model_name)
        if config_prefix_parts:
            self.config_prefix = "_".join(config_prefix_parts)
        # --- end
        # --- verbatim MooncakeStore.__init__ (ranks)
        self.local_rank = (
            storage_config.tp_rank if storage_config is not None else 0
        )
        # --- end
        # --- verbatim MooncakeStore.__init__ (suffixes)
        if storage_config is not None:
            self.is_mla_backend = storage_config.is_mla_model
            self.pp_rank = storage_config.pp_rank
            self.pp_size = storage_config.pp_size
            self.attn_cp_rank = storage_config.attn_cp_rank
            self.attn_cp_size = storage_config.attn_cp_size
        else:
            self.is_mla_backend = False
            self.local_rank = 0
            self.pp_rank = 0
            self.pp_size = 1
            self.attn_cp_rank = 0
            self.attn_cp_size = 1

        self.enable_pp = self.pp_size > 1
        if self.enable_pp:
            self.mha_suffix = f"{self.local_rank}_{self.pp_rank}"
            self.mla_suffix = f"{self.pp_rank}"
        else:
            self.mha_suffix = f"{self.local_rank}"
            self.mla_suffix = ""
        # --- end
        self.should_split_heads = False

    def _tag_keys(self, keys: List[str]) -> List[str]:
        # --- verbatim MooncakeStore._tag_keys
        if self.config_prefix is None:
            return keys
        return [f"{self.config_prefix}_{key}" for key in keys]
        # --- end

    def set_keys(self, keys: List[str]) -> List[str]:
        """The object names ``batch_set_v1`` / ``batch_get_v1`` use for ``keys`` (in order)."""
        keys = self._tag_keys(keys)
        key_list = []
        if self.is_mla_backend:
            # --- verbatim MooncakeStore._get_mla_buffer_meta (keys)
            for key_ in keys:
                key_list.append(f"{key_}_{self.mla_suffix}_k")
            # --- end
        else:
            # --- verbatim MooncakeStore._get_mha_buffer_meta (keys)
            for key_ in keys:
                key_list.append(f"{key_}_{self.mha_suffix}_k")
                key_list.append(f"{key_}_{self.mha_suffix}_v")
            # --- end
        return key_list

    def exists_keys(self, keys: List[str]) -> List[str]:
        """The object names ``batch_exists`` asks about."""
        # --- verbatim MooncakeStore.batch_exists (query keys)
        keys = self._tag_keys(keys)

        if self.is_mla_backend:
            query_keys = [f"{key}_{self.mla_suffix}_k" for key in keys]
        else:
            query_keys = []
            for key in keys:
                query_keys.append(f"{key}_{self.mha_suffix}_k")
                query_keys.append(f"{key}_{self.mha_suffix}_v")
        # --- end
        return query_keys


class MHAHostPool:
    """``MHATokenToKVPoolHost``'s buffer and page accessors (CPU, no allocator)."""

    def __init__(self, layout, size, page_size, layer_num, head_num, head_dim, dtype):
        self.layout, self.size, self.page_size = layout, size, page_size
        self.page_num = size // page_size
        self.layer_num, self.head_num, self.head_dim, self.dtype = layer_num, head_num, head_dim, dtype
        # --- verbatim MHATokenToKVPoolHost.init_kv_buffer (dims)
        if self.layout == "layer_first":
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            dims = (
                2,
                self.page_num,
                self.layer_num,
                self.page_size,
                self.head_num,
                self.head_dim,
            )
        elif self.layout == "page_head":
            dims = (
                2,
                self.page_num,
                self.head_num,
                self.page_size,
                self.layer_num,
                self.head_dim,
            )
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        # --- end
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        # --- verbatim MHATokenToKVPoolHost.get_data_page
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        elif self.layout in ["page_first_direct", "page_head"]:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page
        # --- end

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        # --- verbatim MHATokenToKVPoolHost.set_from_flat_data_page
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = (
                data_page.reshape(
                    2,
                    self.layer_num,
                    self.page_size,
                    self.head_num,
                    self.head_dim,
                )
            )
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = (
                data_page.reshape(
                    2, self.page_size, self.layer_num, self.head_num, self.head_dim
                )
            )
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = (
                data_page.reshape(
                    2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim
                )
            )
        elif self.layout == "page_head":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = (
                data_page.reshape(
                    2, 1, self.head_num, self.page_size, self.layer_num, self.head_dim
                )
            )
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        # --- end

    def get_page_buffer_meta(self, indices):
        # --- verbatim MHATokenToKVPoolHost.get_page_buffer_meta (page-first layouts)
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        v_offset = (
            self.layer_num
            * self.size
            * self.head_num
            * self.head_dim
            * self.dtype.itemsize
        )
        if self.layout in ["page_first", "page_first_direct", "page_head"]:
            for index in range(0, len(indices), self.page_size):
                k_ptr = (
                    kv_buffer_data_ptr
                    + indices[index]
                    * self.layer_num
                    * self.head_num
                    * self.head_dim
                    * self.dtype.itemsize
                )
                v_ptr = k_ptr + v_offset
                ptr_list.append(k_ptr)
                ptr_list.append(v_ptr)
            element_size = (
                self.layer_num
                * self.dtype.itemsize
                * self.page_size
                * self.head_num
                * self.head_dim
            )
            element_size_list = [element_size] * len(ptr_list)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, element_size_list
        # --- end

    def token_kv(self, token: int, layer: int):
        """(K, V) of one token and layer, ``[heads, head_dim]`` each, wherever the layout puts them."""
        p, t = divmod(token, self.page_size)
        if self.layout == "page_first":
            return self.kv_buffer[0, token, layer], self.kv_buffer[1, token, layer]
        if self.layout == "page_first_direct":
            return self.kv_buffer[0, p, layer, t], self.kv_buffer[1, p, layer, t]
        if self.layout == "page_head":
            return self.kv_buffer[0, p, :, t, layer], self.kv_buffer[1, p, :, t, layer]
        raise ValueError(self.layout)


class MLAHostPool:
    """``MLATokenToKVPoolHost``'s buffer and page accessors (CPU, no allocator, dcp_size 1)."""

    def __init__(self, layout, size, page_size, layer_num, kv_cache_dim, dtype):
        self.layout, self.size, self.page_size = layout, size, page_size
        self.page_num = size // page_size
        self.layer_num, self.kv_cache_dim, self.dtype = layer_num, kv_cache_dim, dtype
        # --- verbatim MLATokenToKVPoolHost.init_kv_buffer (dims; Ascend's page_first_kv_split left out)
        if self.layout == "layer_first":
            dims = (
                self.layer_num,
                self.size,
                1,
                self.kv_cache_dim,
            )
        elif self.layout == "page_first":
            dims = (
                self.size,
                self.layer_num,
                1,
                self.kv_cache_dim,
            )
        elif self.layout == "page_first_direct":
            dims = (
                self.page_num,
                self.layer_num,
                self.page_size,
                1,
                self.kv_cache_dim,
            )
        # --- end
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        # --- verbatim MLATokenToKVPoolHost.get_data_page (after the dcp assertion)
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + self.page_size, :, :, :]
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page
        # --- end

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        # --- verbatim MLATokenToKVPoolHost.set_from_flat_data_page
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + self.page_size, :, :] = data_page.reshape(
                self.layer_num,
                self.page_size,
                1,
                self.kv_cache_dim,
            )
        elif self.layout == "page_first":
            self.kv_buffer[index : index + self.page_size, :, :, :] = data_page.reshape(
                self.page_size,
                self.layer_num,
                1,
                self.kv_cache_dim,
            )
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                1,
                self.layer_num,
                self.page_size,
                1,
                self.kv_cache_dim,
            )
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        # --- end

    def get_page_buffer_meta(self, indices):
        # --- verbatim MLATokenToKVPoolHost.get_page_buffer_meta (page-first layouts)
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        if self.layout in ["page_first", "page_first_direct"]:
            for index in range(0, len(indices), self.page_size):
                k_ptr = (
                    kv_buffer_data_ptr
                    + indices[index]
                    * self.layer_num
                    * self.kv_cache_dim
                    * self.dtype.itemsize
                )
                ptr_list.append(k_ptr)
            element_size = (
                self.layer_num
                * self.dtype.itemsize
                * self.page_size
                * self.kv_cache_dim
            )
            element_size_list = [element_size] * len(ptr_list)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, element_size_list
        # --- end

    def token_kv(self, token: int, layer: int):
        """The latent of one token and layer, ``[1, width]``, wherever the layout puts it."""
        p, t = divmod(token, self.page_size)
        if self.layout == "page_first":
            return self.kv_buffer[token, layer]
        if self.layout == "page_first_direct":
            return self.kv_buffer[p, layer, t]
        raise ValueError(self.layout)


def storage_config_from_controller(*, tp_rank, tp_size, pp_rank, pp_size, attn_cp_group_rank_size, is_mla,
                                   layout, model_name, extra_config) -> HiCacheStorageConfig:
    """``HiCacheController._generate_storage_config`` with its inputs given: ``attn_cp_group_rank_size``
    is ``get_attn_cp_rank_and_size()`` — ``(0, 1)`` when no attention-CP group is passed, as
    ``DecodeKVCacheOffloadManager`` passes none."""
    attn_cp_rank, attn_cp_size = attn_cp_group_rank_size
    storage_backend_extra_config = dict(extra_config or {})
    tp_lcm_size = storage_backend_extra_config.pop("tp_lcm_size", None)
    # --- HiCacheController._generate_storage_config's return, self.* given as arguments
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=attn_cp_rank,
        attn_cp_size=attn_cp_size,
        # TODO(hzh): Rename is_mla_model to is_rank_replicated.
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        tp_lcm_size=tp_lcm_size,
        should_split_heads=False,
        extra_config=storage_backend_extra_config,
    )
    # --- end
