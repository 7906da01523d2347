"""Switch SGLang's scheduler over to our manager, and back.

SGLang 0.5.19's scheduler constructs the manager by a module-global name:
``sglang.srt.managers.scheduler`` does ``from sglang.srt.disaggregation.
decode_kvcache_offload_manager import DecodeKVCacheOffloadManager`` and calls it in
``Scheduler.__init__`` when ``--disaggregation-decode-enable-offload-kvcache`` is set. ``install()``
rebinds that name, in the defining module and in every loaded SGLang module holding SGLang's class
under it (as SGLang's own ``HookRegistry`` class REPLACE does), to ours.

SGLang also frees a decode request's KV itself, bypassing the offload manager, when it retracts or
aborts it: ``sglang.srt.mem_cache.common.release_kv_cache`` (imported by name by the scheduler,
the batch result processor, the decode queues ...). ``install()`` wraps that function the same way:
before SGLang frees a request one of our managers tracks, the manager waits for the request's copies
still reading those slots and ends its lifecycle without freeing (``before_sglang_release``); SGLang
then frees as it always did. ``uninstall()`` puts SGLang's class and function back.

SGLang runs schedulers in spawned processes, which do not inherit a patch; they do inherit the
environment. ``install()`` also sets ``KV_LIFECYCLE_SGLANG=1``, and the ``sglang.srt.plugins``
entry point ``kv_lifecycle`` (``plugin``) — which SGLang's ``load_plugins()`` runs at the start of
every scheduler process — installs there when that variable is ``1``. So either ``install()``
before launching SGLang from Python, or ``KV_LIFECYCLE_SGLANG=1`` in the server's environment.

``install()`` first reads the installed SGLang's release (``versions``): one the drop-in is not
tested with (0.5.19, 0.5.23) is refused in one line, unless ``KV_LIFECYCLE_SGLANG_UNTESTED_OK=1``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading

from lifecycle.integrations.sglang import versions
from lifecycle.integrations.sglang.errors import SGLangConfigError

ENV = "KV_LIFECYCLE_SGLANG"
NAME = "DecodeKVCacheOffloadManager"
DEFINING_MODULE = "sglang.srt.disaggregation.decode_kvcache_offload_manager"
RELEASE = "release_kv_cache"
RELEASE_MODULE = "sglang.srt.mem_cache.common"

_lock = threading.Lock()
_original: list = []  # (SGLang's class, SGLang's release_kv_cache, our wrapper of it), while installed


def _ours():
    from lifecycle.integrations.sglang.manager import DecodeKVCacheOffloadManager

    return DecodeKVCacheOffloadManager


def _rebind(attr: str, old, new) -> list[str]:
    """Set ``attr`` to ``new`` in every loaded SGLang module (``sglang``, ``sglang.*``) where it is
    ``old``; the modules changed. Other modules (ours, the application's) are never touched."""
    changed = []
    for name, module in list(sys.modules.items()):
        if not (name == "sglang" or name.startswith("sglang.")):
            continue
        if module is not None and getattr(module, attr, None) is old:
            setattr(module, attr, new)
            changed.append(name)
    return changed


def _release_hook(original):
    """``release_kv_cache`` that first lets our managers settle the request (see the module doc)."""
    from lifecycle.integrations.sglang.manager import active_managers

    @functools.wraps(original)
    def release_kv_cache(req, tree_cache, *args, **kwargs):
        proceed = True
        for mgr in active_managers():
            proceed = mgr.before_sglang_release(req) and proceed
        if proceed:
            return original(req, tree_cache, *args, **kwargs)
        return None

    return release_kv_cache


def _import(module_name: str, attr: str):
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SGLangConfigError(f"cannot install into SGLang: {module_name} does not import ({err})") from err
    value = getattr(module, attr, None)
    if value is None:
        raise SGLangConfigError(f"cannot install into SGLang: {module_name} has no {attr}")
    return value


def install() -> list[str]:
    """Make SGLang construct our ``DecodeKVCacheOffloadManager``; idempotent.

    Returns:
        The modules whose ``DecodeKVCacheOffloadManager`` now names ours (the defining module,
        and ``sglang.srt.managers.scheduler`` when it is loaded).
    Raises:
        SGLangConfigError: the installed SGLang is a release the drop-in is not tested with (one
            line naming the tested ones and ``KV_LIFECYCLE_SGLANG_UNTESTED_OK=1``, which forces
            it); SGLang's decode offload module or ``release_kv_cache`` cannot be imported.
            Nothing changes, the environment included.
    """
    versions.release_of(None)  # the installed sglang's release, checked before anything changes
    ours = _ours()
    with _lock:
        if not _original:
            cls, release = _import(DEFINING_MODULE, NAME), _import(RELEASE_MODULE, RELEASE)
            _original.append((cls, release, _release_hook(release)))
        cls, release, hook = _original[0]
        _rebind(NAME, cls, ours)  # again on a repeated install: modules imported since
        _rebind(RELEASE, release, hook)
        os.environ[ENV] = "1"
        return sorted(n for n, m in list(sys.modules.items())
                      if n.startswith("sglang.") and m is not None and getattr(m, NAME, None) is ours)


def uninstall() -> list[str]:
    """Put SGLang's own manager back wherever ours was bound, and unset ``KV_LIFECYCLE_SGLANG``.

    Returns:
        The modules restored (empty when not installed).
    """
    with _lock:
        os.environ.pop(ENV, None)
        if not _original:
            return []
        cls, release, hook = _original.pop()
        _rebind(RELEASE, hook, release)
        return sorted(_rebind(NAME, _ours(), cls))


def installed() -> bool:
    """Whether ``install()`` is in force in this process."""
    return bool(_original)


def plugin() -> None:
    """SGLang ``sglang.srt.plugins`` entry point: install when ``KV_LIFECYCLE_SGLANG=1``, else nothing."""
    if os.environ.get(ENV) == "1":
        install()
