"""Switch SGLang's scheduler over to our manager, and back.

SGLang 0.5.19's scheduler constructs the manager by a module-global name:
``sglang.srt.managers.scheduler`` does ``from sglang.srt.disaggregation.
decode_kvcache_offload_manager import DecodeKVCacheOffloadManager`` and calls it in
``Scheduler.__init__`` when ``--disaggregation-decode-enable-offload-kvcache`` is set. ``install()``
rebinds that name, in the defining module and in every loaded module holding SGLang's class under
it (as SGLang's own ``HookRegistry`` class REPLACE does), to ours. ``uninstall()`` puts SGLang's back.

SGLang runs schedulers in spawned processes, which do not inherit a patch; they do inherit the
environment. ``install()`` also sets ``KV_LIFECYCLE_SGLANG=1``, and the ``sglang.srt.plugins``
entry point ``kv_lifecycle`` (``plugin``) — which SGLang's ``load_plugins()`` runs at the start of
every scheduler process — installs there when that variable is ``1``. So either ``install()``
before launching SGLang from Python, or ``KV_LIFECYCLE_SGLANG=1`` in the server's environment.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

from lifecycle.integrations.sglang.errors import SGLangConfigError

ENV = "KV_LIFECYCLE_SGLANG"
NAME = "DecodeKVCacheOffloadManager"
DEFINING_MODULE = "sglang.srt.disaggregation.decode_kvcache_offload_manager"

_lock = threading.Lock()
_original: list = []  # SGLang's class, while installed


def _ours():
    from lifecycle.integrations.sglang.manager import DecodeKVCacheOffloadManager

    return DecodeKVCacheOffloadManager


def _rebind(old, new) -> list[str]:
    """Set ``NAME`` to ``new`` in every loaded module where it is ``old``; the modules changed."""
    changed = []
    for name, module in list(sys.modules.items()):
        if module is not None and getattr(module, NAME, None) is old:
            setattr(module, NAME, new)
            changed.append(name)
    return changed


def install() -> list[str]:
    """Make SGLang construct our ``DecodeKVCacheOffloadManager``; idempotent.

    Returns:
        The modules whose ``DecodeKVCacheOffloadManager`` now names ours (the defining module,
        and ``sglang.srt.managers.scheduler`` when it is loaded).
    Raises:
        SGLangConfigError: SGLang's decode offload module cannot be imported or has no such class
            (nothing changes, the environment included).
    """
    ours = _ours()
    with _lock:
        try:
            module = importlib.import_module(DEFINING_MODULE)
        except ImportError as err:
            raise SGLangConfigError(f"cannot install into SGLang: {DEFINING_MODULE} does not import ({err})") from err
        current = getattr(module, NAME, None)
        if current is None:
            raise SGLangConfigError(f"cannot install into SGLang: {DEFINING_MODULE} has no {NAME}")
        if _original:
            _rebind(_original[0], ours)  # modules imported since the last install
        else:
            _original.append(current)
            _rebind(current, ours)
        os.environ[ENV] = "1"
        return sorted(n for n, m in list(sys.modules.items()) if m is not None and getattr(m, NAME, None) is ours)


def uninstall() -> list[str]:
    """Put SGLang's own manager back wherever ours was bound, and unset ``KV_LIFECYCLE_SGLANG``.

    Returns:
        The modules restored (empty when not installed).
    """
    with _lock:
        os.environ.pop(ENV, None)
        if not _original:
            return []
        restored = _rebind(_ours(), _original.pop())
        return sorted(restored)


def installed() -> bool:
    """Whether ``install()`` is in force in this process."""
    return bool(_original)


def plugin() -> None:
    """SGLang ``sglang.srt.plugins`` entry point: install when ``KV_LIFECYCLE_SGLANG=1``, else nothing."""
    if os.environ.get(ENV) == "1":
        install()
