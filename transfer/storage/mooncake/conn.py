"""The Mooncake client side: settings from a ``mooncake://`` spec, a bounded-time connection, and
what Mooncake's return codes mean to us.

``mooncake://HOST:PORT[?name=value&...]`` names a Mooncake master's RPC address. The client is
``mooncake.store.MooncakeDistributedStore`` from the optional extra ``kv-lifecycle[mooncake]``
(``mooncake-transfer-engine`` on CUDA machines, ``mooncake-transfer-engine-non-cuda`` elsewhere;
it needs ``libibverbs1`` even over TCP).

Connecting is bounded: the master's port is probed with a plain TCP connect first (a master that
is not there fails in ``connect_timeout_s``, not in the ~90 s Mooncake's own ``setup`` retries for),
then ``setup`` runs on a helper thread and is waited for at most ``setup_timeout_s``. A setup that
finishes after its caller gave up closes its own client, so nothing leaks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import sys
import tempfile
import threading
from urllib.parse import parse_qsl, urlsplit

import msgspec

from transfer.errors import StorageConfigError, StorageUnavailable
from transfer.storage.identity import IDENTITY_OPTIONS
from transfer.log import get_logger

log = get_logger(__name__)

EXTRA_HINT = ("the Mooncake storage tier needs the optional extra: pip install 'kv-lifecycle[mooncake]' "
              "(mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")

# Mooncake's ErrorCode (mooncake-store/include/types.h) -> what it means for one object.
OK = 0
MISSING_CODES = frozenset({-703, -704, -707, -710, -712, -713})  # not ready / not found / lease / replica gone
ABSENT_HOLDER = -800  # TRANSFER_FAIL: the client holding the replica is gone (until the master drops it)
TOO_BIG = -600  # INVALID_PARAMS: e.g. the object is larger than the buffer (another page size)
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room (or none is mounted yet)
EXISTS = -705  # OBJECT_ALREADY_EXISTS
HAS_LEASE = -706  # OBJECT_HAS_LEASE (remove right after a read; removed with force)
UNREACHABLE_CODES = frozenset({-900, -901, -902, -1010})  # RPC_FAIL / RPC_TIMEOUT / ... : the master
CODE_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -200: "NO_AVAILABLE_HANDLE",
              -600: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
              -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
              -712: "REPLICA_IS_GONE", -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT"}


def code_name(code: int) -> str:
    return f"{CODE_NAMES.get(code, 'ERROR')}({code})"


_SIZE = re.compile(r"\s*(\d+)\s*([kmgt]?)(i?b?)\s*\Z", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"64MiB"`` / ``"4GB"`` / ``"1048576"`` -> bytes (K/M/G/T are powers of 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if m is None:
        raise StorageConfigError(f"not a byte size: {text!r} (e.g. 256MiB, 4GB, 1048576)")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


class MooncakeSettings(msgspec.Struct, frozen=True):
    """Everything a ``mooncake://`` spec can set (query parameter names are the field names).

    Args:
        master: the master's ``HOST:PORT``.
        local_hostname: the address this client advertises to peers (default: 127.0.0.1 for a
            loopback master, else this host's name). Loopback also binds the TCP transport there.
        metadata_server: ``P2PHANDSHAKE`` (no etcd) or an etcd/HTTP metadata URL.
        protocol: ``tcp`` or ``rdma``. device_name: RDMA device(s) ('' for TCP).
        global_segment_size: memory this process contributes to the store (0: none; its objects
            live on other clients, e.g. a ``mooncake_client`` segment holder).
        local_buffer_size: Mooncake's own staging buffer (unused by the zero-copy path).
        replica_num: copies of each object (>= 1; 2 survives one holder's death).
        preferred_segment: segment (``host:port`` of a client) to place objects on ('': any;
            ``local``: this client's own segment, so a node's own reuse is a memory copy).
        connect_timeout_s: TCP probe of the master. setup_timeout_s: bound on ``setup``.
        exists_timeout_s: deadline of one existence check (``PrefixLoader`` has its own, shorter).
        lazy: do not fail at open when the master is away; connect in the background.
        require_checksum: a page without our seal (written by SGLang) is a miss.
        seal: write a seal object per page (False: pure SGLang objects, nothing else).

    Object names come from the deployment identity (``transfer.storage.identity``), not from
    these settings: ``open_storage`` takes the identity options of a URL (``model``, ``tp_rank``,
    ...) off before the rest is parsed here.
    """

    master: str
    local_hostname: str | None = None
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 256 << 20
    local_buffer_size: int = 0
    replica_num: int = 1
    preferred_segment: str = ""
    connect_timeout_s: float = 0.5
    setup_timeout_s: float = 15.0
    exists_timeout_s: float = 1.0
    lazy: bool = False
    require_checksum: bool = False
    seal: bool = True

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.master.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def hostname(self) -> str:
        if self.local_hostname:
            return self.local_hostname
        host = self.host_port[0]
        return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else socket.gethostname()


_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_INT = {"replica_num"}
_FLOAT = {"connect_timeout_s", "setup_timeout_s", "exists_timeout_s"}
_SIZES = {"global_segment_size", "local_buffer_size"}
_BOOLS = {"lazy", "require_checksum", "seal"}


def parse_spec(spec: str, **overrides) -> MooncakeSettings:
    """``mooncake://HOST:PORT?k=v&...`` -> settings (``overrides`` win over the query).

    Raises:
        StorageConfigError: not a mooncake URL, no port, an unknown or malformed parameter.
    """
    parts = urlsplit(spec)
    if parts.scheme != "mooncake" or not parts.hostname or parts.path not in ("", "/"):
        raise StorageConfigError(f"expected mooncake://HOST:PORT[?options], got {spec!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise StorageConfigError(f"mooncake spec needs the master's RPC port: {spec!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    fields: dict = {"master": f"{host}:{port}"}
    known = set(MooncakeSettings.__struct_fields__) - {"master"}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in IDENTITY_OPTIONS:
            raise StorageConfigError(f"mooncake option {name!r} is part of the deployment identity: give it to "
                                     "open_storage (the URL) or as identity=, not to parse_spec")
        if name not in known:
            raise StorageConfigError(f"unknown mooncake option {name!r} (known: {', '.join(sorted(known))})")
        fields[name] = _convert(name, value)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    settings = MooncakeSettings(**fields)
    if settings.replica_num < 1 or settings.global_segment_size < 0 or settings.protocol not in ("tcp", "rdma"):
        raise StorageConfigError(f"bad mooncake options in {spec!r}: replica_num >= 1, protocol tcp|rdma")
    return settings


def _convert(name: str, value: str):
    try:
        if name in _INT:
            return int(value)
        if name in _FLOAT:
            out = float(value)
            if not out > 0:
                raise ValueError
            return out
        if name in _SIZES:
            return parse_size(value)
        if name in _BOOLS:
            return _BOOL[value.lower()]
    except (ValueError, KeyError):
        raise StorageConfigError(f"bad value for mooncake option {name}: {value!r}") from None
    return value


def import_store():
    """``(MooncakeDistributedStore, ReplicateConfig)``; StorageUnavailable naming the extra when missing."""
    for name, value in PROCESS_DEFAULTS.items():  # read when the C++ library loads / sets up
        os.environ.setdefault(name, value)
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as err:  # the package, or a shared library (libibverbs) it needs
        raise StorageUnavailable(f"{EXTRA_HINT}: {err}") from err
    return MooncakeDistributedStore, ReplicateConfig


def probe(host: str, port: int, timeout_s: float) -> str | None:
    """None when something accepts TCP connections at ``host:port``, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


# Mooncake's process-wide settings (environment, read by its C++ client), set only when unset:
# errors-only C++ logging; master RPCs (metadata only, no page bytes) time out after 2 s instead of
# 30 s; one setup attempt instead of ~20. Mooncake's setup and close hold the GIL, so these bound
# how long a master that accepts connections but never answers can freeze the process (~2 s).
PROCESS_DEFAULTS = {"MC_LOG_LEVEL": "ERROR", "MC_RPC_TIMEOUT_MS": "2000", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}


def _quiet_env(settings: MooncakeSettings) -> None:
    """A loopback client also binds its TCP transport to loopback (unless MC_TCP_BIND_ADDRESS is set)."""
    if settings.hostname.startswith("127."):
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.hostname)


def setup_client(settings: MooncakeSettings):
    """A set-up client, or raise StorageUnavailable (blocks for as long as Mooncake's setup does)."""
    store_cls, _ = import_store()
    _quiet_env(settings)
    store = store_cls()
    with setup_noise_dropped():
        rc = store.setup(settings.hostname, settings.metadata_server, settings.global_segment_size,
                         settings.local_buffer_size, settings.protocol, settings.device_name, settings.master)
    if rc != 0:
        close_quietly(store)
        raise StorageUnavailable(f"mooncake setup against master {settings.master} failed (code {rc})")
    return store


# The two lines Mooncake's C++ client writes to stderr on every healthy start, whatever MC_LOG_LEVEL
# (it maps only TRACE/INFO/WARNING/ERROR onto glog's minloglevel, overriding GLOG_minloglevel): its
# TCP transport, installed in P2P-handshake mode before the client's own segment is registered,
# answers its first handshake with LOG(ERROR) "Local segment descriptor not found"
# (transfer_metadata.cpp, TransferMetadata::receivePeerMetadata), and glog prefixes the first line
# of a process with a warning that it was never initialised.
SETUP_NOISE = (re.compile(rb"^WARNING: Logging before InitGoogleLogging\(\) is written to STDERR\r?\n?$"),
               re.compile(rb"^E\d{4} [\d:.]+ +\d+ transfer_metadata\.cpp:\d+\] Local segment descriptor not found\r?\n?$"))


@contextlib.contextmanager
def setup_noise_dropped():
    """Hold file descriptor 2 in a temporary file while the block runs (Mooncake's ``setup``, which
    holds the GIL: no Python thread writes meanwhile), then write back every line but the known
    start-up noise (``SETUP_NOISE``), in order. A healthy start prints nothing; any other line —
    a real setup error — still reaches stderr. Without a usable fd 2 the block just runs."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    held = tempfile.TemporaryFile()
    try:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
    finally:
        os.close(saved)
        held.seek(0)
        lines = held.read().splitlines(keepends=True)
        held.close()
        kept = [line for line in lines if not any(p.match(line) for p in SETUP_NOISE)]
        if kept:
            os.write(2, b"".join(kept))
        if len(kept) < len(lines):
            log.debug("mooncake.setup_noise_dropped", lines=len(lines) - len(kept))


def close_quietly(store) -> None:
    """Close a client; a failure to close is logged at debug and otherwise ignored."""
    try:
        store.close()
    except Exception as err:  # noqa: BLE001 - a failing close of a dead client changes nothing
        log.debug("mooncake.close_failed", error=str(err))


def park(store, master: str) -> None:
    """Keep ``store`` alive for the life of the process without closing it: with its master
    gone, Mooncake's close (and destructor) would hold the GIL for ~17 s. One extra reference
    that is never dropped means it is not destroyed at exit either (the OS reclaims it)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
    log.warning("mooncake.client_parked", master=master,
                detail="master unreachable at close; the client is left open until the process exits")


def connect(settings: MooncakeSettings):
    """Probe the master, then ``setup`` with a deadline. Returns the client.

    Raises:
        StorageUnavailable: the extra is missing, nothing listens at the master's address, setup
            failed, or it did not finish within ``setup_timeout_s`` (one line naming the master).
            A setup still running at the deadline closes its client when it ends (nothing leaks).
    """
    import_store()
    host, port = settings.host_port
    reason = probe(host, port, settings.connect_timeout_s)
    if reason is not None:
        raise StorageUnavailable(f"mooncake master at {settings.master} is unreachable: {reason}")
    box: dict = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            store = setup_client(settings)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            with lock:
                box["error"] = err
            return
        with lock:
            if box.get("abandoned"):
                close_quietly(store)
            else:
                box["store"] = store

    thread = threading.Thread(target=run, name="kv-mooncake-setup", daemon=True)
    thread.start()
    thread.join(settings.setup_timeout_s)
    with lock:
        box["abandoned"] = True
        store, error = box.pop("store", None), box.get("error")
    if error is not None:
        raise error
    if store is None:
        raise StorageUnavailable(
            f"mooncake master at {settings.master} did not complete setup within {settings.setup_timeout_s} s")
    return store
