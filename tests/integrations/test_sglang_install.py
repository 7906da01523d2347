"""``install()`` / ``uninstall()`` / the plugin entry point: SGLang's scheduler constructs ours
instead of its own, by the module-global name it looks up, and switches back.

Without sglang installed, the two modules involved are stand-ins registered in ``sys.modules``
under SGLang's names, holding what SGLang 0.5.19's hold: the defining module's class, and the
scheduler module's ``from ... import DecodeKVCacheOffloadManager`` binding used by
``Scheduler.__init__``. Where sglang is importable the real modules are patched instead."""

from __future__ import annotations

import os
import sys
import tomllib
import types
from pathlib import Path

import pytest

import lifecycle.integrations.sglang as integration
from lifecycle.integrations.sglang import ENV, SGLangConfigError, install, installed, plugin, uninstall
from lifecycle.integrations.sglang.install import DEFINING_MODULE, RELEASE_MODULE

SCHEDULER = "sglang.srt.managers.scheduler"
ROOT = Path(__file__).resolve().parents[2]


class SGLangsOwn:
    """Stands in for SGLang's class in the stand-in modules."""

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, tp_group, tree_cache):
        raise AssertionError("SGLang's own manager was constructed")


def sglangs_release_kv_cache(req, tree_cache, is_insert=True):
    """Stands in for ``sglang.srt.mem_cache.common.release_kv_cache``."""
    tree_cache.append(req)


def _construct_as_scheduler(scheduler_module):
    """``Scheduler.__init__``: the name is looked up in the scheduler module's globals at call time."""
    cls = scheduler_module.DecodeKVCacheOffloadManager
    return cls


@pytest.fixture
def sglang_modules(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    try:
        import sglang.srt.disaggregation.decode_kvcache_offload_manager  # noqa: F401
    except ImportError:
        for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.managers",
                     "sglang.srt.mem_cache"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        defining = types.ModuleType(DEFINING_MODULE)
        defining.DecodeKVCacheOffloadManager = SGLangsOwn
        common = types.ModuleType(RELEASE_MODULE)
        common.release_kv_cache = sglangs_release_kv_cache
        scheduler = types.ModuleType(SCHEDULER)
        scheduler.DecodeKVCacheOffloadManager = SGLangsOwn
        scheduler.release_kv_cache = sglangs_release_kv_cache
        for module in (defining, common, scheduler):
            monkeypatch.setitem(sys.modules, module.__name__, module)
    own = sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager
    originals[RELEASE_MODULE] = sys.modules[RELEASE_MODULE].release_kv_cache
    yield own
    uninstall()


originals: dict = {}


def test_install_rebinds_the_name_the_scheduler_constructs_and_uninstall_restores(sglang_modules):
    own = sglang_modules
    assert not installed()
    changed = install()
    ours = integration.DecodeKVCacheOffloadManager
    assert DEFINING_MODULE in changed
    assert sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager is ours
    if SCHEDULER in sys.modules:
        assert SCHEDULER in changed
        assert _construct_as_scheduler(sys.modules[SCHEDULER]) is ours
    assert installed() and os.environ[ENV] == "1"
    release = sys.modules[RELEASE_MODULE].release_kv_cache
    assert release.__wrapped__ is originals[RELEASE_MODULE] and release is not release.__wrapped__
    if SCHEDULER in sys.modules:
        assert sys.modules[SCHEDULER].release_kv_cache is release
    assert install() == changed  # idempotent
    restored = uninstall()
    assert DEFINING_MODULE in restored
    assert sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager is own
    if SCHEDULER in sys.modules:
        assert sys.modules[SCHEDULER].DecodeKVCacheOffloadManager is own
    assert not installed() and ENV not in os.environ
    assert sys.modules[RELEASE_MODULE].release_kv_cache is release.__wrapped__
    if SCHEDULER in sys.modules:
        assert sys.modules[SCHEDULER].release_kv_cache is release.__wrapped__
    assert uninstall() == []


def test_the_release_hook_calls_sglangs_release_when_no_manager_tracks_the_request(sglang_modules):
    if sglang_modules is not SGLangsOwn:
        pytest.skip("needs the stand-in release_kv_cache")
    install()
    calls = []
    sys.modules[RELEASE_MODULE].release_kv_cache("req", calls)
    assert calls == ["req"]


def test_a_module_imported_after_install_gets_ours(sglang_modules, monkeypatch):
    install()
    late = types.ModuleType("sglang.srt.late_importer")
    late.DecodeKVCacheOffloadManager = sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager  # from-import
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.DecodeKVCacheOffloadManager is integration.DecodeKVCacheOffloadManager
    uninstall()
    assert late.DecodeKVCacheOffloadManager is sglang_modules
    assert integration.DecodeKVCacheOffloadManager.__module__ == "lifecycle.integrations.sglang.manager"


def test_the_plugin_installs_only_when_switched_on(sglang_modules, monkeypatch):
    plugin()
    assert not installed()
    monkeypatch.setenv(ENV, "1")
    plugin()
    assert installed()
    assert sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager is integration.DecodeKVCacheOffloadManager


def test_install_without_sglang_is_a_config_error_and_changes_nothing(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setitem(sys.modules, DEFINING_MODULE, None)  # import of it fails, as without sglang
    with pytest.raises(SGLangConfigError, match="cannot install into SGLang"):
        install()
    assert not installed() and ENV not in os.environ


def test_the_entry_point_is_declared_for_sglangs_plugin_loader():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    points = project["project"]["entry-points"]["sglang.srt.plugins"]
    assert points["kv_lifecycle"] == "lifecycle.integrations.sglang.install:plugin"


def test_importing_the_integration_imports_no_sglang():
    code = ("import sys, lifecycle, lifecycle.integrations.sglang as s; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'sglang imported'; "
            "assert 'lifecycle_tools' not in sys.modules")
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("switch", ["1", None], ids=["on", "off"])
def test_sglangs_plugin_loader_installs_ours_only_when_switched_on(switch):
    """Where sglang is importable and kv-lifecycle is installed with its entry points: what
    ``run_scheduler_process`` does first (``load_plugins()``), in a fresh process."""
    from tests.integrations.sglang_kit import require_sglang

    require_sglang()
    from importlib.metadata import entry_points

    if not any(ep.name == "kv_lifecycle" for ep in entry_points(group="sglang.srt.plugins")):
        pytest.skip("kv-lifecycle is installed without its sglang.srt.plugins entry point (reinstall it)")
    import subprocess

    code = ("import sglang.srt.managers.scheduler as s, lifecycle.integrations.sglang as L\n"
            "from sglang.srt.plugins import load_plugins\n"
            "own = s.DecodeKVCacheOffloadManager\n"
            "load_plugins()\n"
            "print(s.DecodeKVCacheOffloadManager is L.DecodeKVCacheOffloadManager, s.DecodeKVCacheOffloadManager is own)")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if switch:
        env[ENV] = switch
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()[-2:]
    assert out == (["True", "False"] if switch else ["False", "True"])
