"""Errors of the vLLM integration, in the lifecycle's hierarchy."""

from __future__ import annotations

from lifecycle.errors import ConfigError


class VllmConfigError(ConfigError):
    """vLLM's configuration, KV cache or a request asks for something the connector does not
    support (a layout it cannot store as an SGLang node's pages, an untested vLLM release, a
    request field that would change a page's meaning). Raised at construction (or, for a request,
    before anything of it is planned); one line naming what was found and what is supported."""


class VllmLayoutError(VllmConfigError):
    """The KV tensors vLLM allocated cannot be laid out as the host pages an SGLang node stores
    (``layout.VllmKVLayout``)."""
