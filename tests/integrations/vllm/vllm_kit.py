"""Shared by the vLLM tests: skip without vLLM 0.32 (fail under ``KV_LIFECYCLE_REQUIRE_VLLM=1``,
which ``.ci/vllm-env`` sets), and the rig (``lifecycle_tools.testkit.vllm_engine``)."""

from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "KV_LIFECYCLE_REQUIRE_VLLM"


def require_vllm() -> None:
    """Skip the calling test when vLLM's scheduler does not import here, unless
    ``KV_LIFECYCLE_REQUIRE_VLLM=1``: then a missing vLLM fails the test instead of skipping it."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
    except ImportError as err:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but vLLM does not import: {err}")
        pytest.skip(f"vLLM is not importable here ({err})")
