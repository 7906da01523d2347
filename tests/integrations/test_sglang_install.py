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
        import sglang.srt.mem_cache.common  # noqa: F401 (0.5.23's offload module does not import it)
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


# --- the release gate (issue 36): install() and construction read SGLang's release ----------------

from lifecycle.integrations.sglang import versions  # noqa: E402
from lifecycle.integrations.sglang.versions import TESTED, UNTESTED_OK_ENV  # noqa: E402


def _one_line_refusal(err, version: str) -> None:
    text = str(err.value)
    assert "\n" not in text and f"SGLang {version}" in text
    assert all(t in text for t in TESTED) and f"{UNTESTED_OK_ENV}=1" in text


@pytest.mark.parametrize("version", ["0.5.18", "0.5.22", "0.6.0", "0.5.23rc1"])
def test_install_refuses_an_untested_release_in_one_line_and_changes_nothing(sglang_modules, monkeypatch, version):
    monkeypatch.setattr(versions, "installed_version", lambda: version)
    monkeypatch.delenv(UNTESTED_OK_ENV, raising=False)
    own = sglang_modules
    release = sys.modules[RELEASE_MODULE].release_kv_cache
    with pytest.raises(SGLangConfigError) as err:
        install()
    _one_line_refusal(err, version)
    assert not installed() and ENV not in os.environ
    assert sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager is own
    assert sys.modules[RELEASE_MODULE].release_kv_cache is release
    monkeypatch.setenv(ENV, "1")  # the plugin in a scheduler process: the same refusal
    with pytest.raises(SGLangConfigError, match=UNTESTED_OK_ENV):
        plugin()
    assert not installed()


@pytest.mark.parametrize("version", [*TESTED, "0.5.23+cu130"])
def test_install_accepts_the_tested_releases(sglang_modules, monkeypatch, version):
    monkeypatch.setattr(versions, "installed_version", lambda: version)
    monkeypatch.delenv(UNTESTED_OK_ENV, raising=False)
    install()
    assert installed() and sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager is integration.DecodeKVCacheOffloadManager


@pytest.mark.parametrize("forced", ["0", "", "true"])
def test_only_the_exact_force_value_forces_an_untested_release(sglang_modules, monkeypatch, forced):
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.22")
    monkeypatch.setenv(UNTESTED_OK_ENV, forced)
    with pytest.raises(SGLangConfigError, match="not a release"):
        install()
    assert not installed()


def test_the_force_installs_an_untested_release(sglang_modules, monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.22")
    monkeypatch.setenv(UNTESTED_OK_ENV, "1")
    install()
    assert installed() and sys.modules[DEFINING_MODULE].DecodeKVCacheOffloadManager is integration.DecodeKVCacheOffloadManager


@pytest.mark.parametrize("version,behaves_as", [("0.5.20", "0.5.19"), ("0.5.22", "0.5.19"), ("0.5.24", "0.5.23"),
                                                ("0.6.0rc2", "0.5.23"), ("0.5.10", "0.5.19"), ("dev", "0.5.19")])
def test_a_forced_release_follows_the_nearest_tested_release_at_or_below_it(version, behaves_as):
    release = versions.check(version, "test", {UNTESTED_OK_ENV: "1"})
    assert (release.version, release.behaves_as) == (version, behaves_as)


def _doubles_node(declared):
    """SGLang-shaped pools (the doubles), and a runtime context declaring ``declared`` (None: none,
    so the installed sglang's release is read)."""
    from lifecycle_tools.testkit.sglang_doubles import runtime_context
    from tests.integrations.sglang_kit import Node, doubles_kit

    node = Node(doubles_kit(), page_size=4)
    ctx = runtime_context(page_size=4)
    if declared is None:
        del ctx.sglang_version
    else:
        ctx.sglang_version = declared
    return node, ctx


def _construct(node, ctx):
    from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime

    with use_runtime(ctx):
        return DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                           tp_group=None, tree_cache=node.tree)


@pytest.mark.parametrize("where", ["installed", "declared"])
def test_construction_refuses_an_untested_release_in_one_line_before_allocating(tmp_path, monkeypatch, where):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    monkeypatch.delenv(UNTESTED_OK_ENV, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.22" if where == "installed" else "0.5.19")
    node, ctx = _doubles_node(None if where == "installed" else "0.5.22")
    free = node.alloc.available_size()
    with pytest.raises(SGLangConfigError) as err:
        _construct(node, ctx)
    _one_line_refusal(err, "0.5.22")
    assert node.alloc.available_size() == free and not (tmp_path / "hicache").exists()
    from lifecycle.integrations.sglang.manager import active_managers

    assert active_managers() == []


@pytest.mark.parametrize("version,behaves_as", [("0.5.19", "0.5.19"), ("0.5.23", "0.5.23"), ("0.5.24", "0.5.23")])
def test_construction_reads_the_installed_release_and_the_force_admits_an_untested_one(
        tmp_path, monkeypatch, version, behaves_as):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    monkeypatch.setenv(UNTESTED_OK_ENV, "1")
    monkeypatch.setattr(versions, "installed_version", lambda: version)
    node, ctx = _doubles_node(None)
    if behaves_as == "0.5.23":  # 0.5.23 releases through the tree lock: a tree cache without unlock is refused
        with pytest.raises(SGLangConfigError, match=r"has no unlock\(lock\) \(SGLang 0.5.23\)"):
            _construct(node, ctx)
        node.tree.unlock = lambda lock: None
    mgr = _construct(node, ctx)
    try:
        assert (mgr.sglang_release.version, mgr.sglang_release.behaves_as) == (version, behaves_as)
        assert mgr.config.sglang_release == behaves_as and mgr.release_sink.release is mgr.sglang_release
    finally:
        mgr.release_host_resources()


def test_without_sglang_or_a_declared_release_the_drop_in_follows_0_5_19(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    monkeypatch.setattr(versions, "installed_version", lambda: None)
    node, ctx = _doubles_node(None)
    mgr = _construct(node, ctx)
    try:
        assert (mgr.sglang_release.version, mgr.sglang_release.behaves_as) == (None, "0.5.19")
    finally:
        mgr.release_host_resources()


def test_the_installed_release_is_read_from_the_sglang_distribution():
    from importlib import metadata

    try:
        expected = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        expected = None
    assert versions.installed_version() == expected
