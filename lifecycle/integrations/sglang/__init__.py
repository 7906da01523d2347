"""kv-lifecycle inside SGLang (0.5.19, 0.5.23): a drop-in ``DecodeKVCacheOffloadManager``.

``install()`` (or ``KV_LIFECYCLE_SGLANG=1`` in the server's environment) makes SGLang's decode
scheduler construct ours; ``uninstall()`` switches back. See docs/integration.md, "Running inside
SGLang". Nothing here imports sglang until a manager is constructed or ``install()`` is called.
"""

from lifecycle.integrations.sglang.config import OffloadConfig, read_config
from lifecycle.integrations.sglang.errors import SGLangConfigError
from lifecycle.integrations.sglang.install import ENV, install, installed, plugin, uninstall
from lifecycle.integrations.sglang.manager import DecodeKVCacheOffloadManager, OngoingOffload
from lifecycle.integrations.sglang.release import SGLangReleaseSink
from lifecycle.integrations.sglang.runtime import use_runtime

__all__ = [
    "ENV",
    "DecodeKVCacheOffloadManager",
    "OffloadConfig",
    "OngoingOffload",
    "SGLangConfigError",
    "SGLangReleaseSink",
    "install",
    "installed",
    "plugin",
    "read_config",
    "uninstall",
    "use_runtime",
]
