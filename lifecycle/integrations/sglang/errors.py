"""Errors of the SGLang integration, in the lifecycle's hierarchy."""

from __future__ import annotations

from lifecycle.errors import ConfigError


class SGLangConfigError(ConfigError):
    """SGLang's configuration (runtime context, environment, pools) asks for something this
    integration does not support, or is malformed. Raised at construction, before any resource
    (host pool, storage directory, worker thread) is created; the message names the setting, the
    value found and what is supported."""
