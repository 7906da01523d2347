"""The reference scheduler's configuration, declared once.

``OPTIONS`` is the one declaration of every setting: its name, default, help, command-line group
and value kind. ``SimConfig`` (the dataclass a run takes), the ``kv-lifecycle simulate`` flags and
their help (``lifecycle_tools.cli``), and the per-field checks of ``validate`` are all generated
from it, so a new setting is one line here. ``validate`` then checks what no single field can:
combinations, the largest request the distributions can produce against the pools, and the
memory the pools need against the machine's, all before anything is allocated or generated.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from lifecycle_tools.simulate import options as k
from lifecycle_tools.simulate.dist import parse_dist
from lifecycle_tools.simulate.errors import ConfigProblem

MODEL, POOLS, WORKLOAD, STORAGE = "model shape", "pools and offload", "workload", "storage, reuse and checks"
OBSERVE = "metrics and KV events"


@dataclass(frozen=True)
class Option:
    """One setting. ``cli``: its flag (None: not on the command line); ``action``: an argparse
    boolean action for on/off flags (``store_false`` flags set the field to False)."""

    name: str
    default: object
    kind: object
    help: str
    group: str | None = None
    cli: str | None = ""
    action: str | None = None

    @property
    def flag(self) -> str:
        return self.cli or "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("layers", 4, k.integer(1), "layers", MODEL),
    Option("heads", 4, k.integer(1), "KV heads", MODEL),
    Option("head_dim", 64, k.integer(1), "head dim", MODEL),
    Option("dtype", "bf16", k.dtype, "KV dtype: bf16, fp16, fp32, fp8", MODEL),
    Option("page_size", 16, k.integer(1, 1 << 16), "tokens per page", POOLS),
    Option("stride", None, k.integer(1, optional=True), "tokens per offload chunk, a page multiple "
           "(default: page size)", POOLS),
    Option("device_tokens", 16_384, k.integer(1, 1 << 40), "device KV slots", POOLS),
    Option("host_tokens", 8_192, k.integer(1, 1 << 40), "host pool tokens", POOLS),
    Option("rows", 32, k.integer(1, 1 << 20), "req-to-token rows", POOLS),
    Option("max_running", None, k.integer(1, optional=True), "decode batch cap (default: rows)", POOLS),
    Option("spec_tokens", 0, k.integer(0, 1 << 16), "speculative over-allocation: allocated = "
           "committed + N, 1..N+1 accepted per step", POOLS),
    Option("device", "cpu", k.device, "cpu, cuda or cuda:N", POOLS),
    Option("requests", 64, k.integer(1), "requests in all", WORKLOAD),
    Option("turns", 2, k.integer(1, 1 << 16), "turns per chat; later turns extend earlier ones", WORKLOAD),
    Option("system_prompt", 48, k.integer(0, 1 << 22), "tokens of a system prompt every chat shares",
           WORKLOAD),
    Option("prompt_len", "32-256", k.dist, "new prompt tokens per turn: N, LO-HI, exp:MEAN[:MAX], "
           "normal:MEAN:STD", WORKLOAD),
    Option("output_len", "32-160", k.dist, "output tokens per request (same spellings)", WORKLOAD),
    Option("arrival_rate", 0.5, k.rate, "chats arriving per step, Poisson; 0 = all at once", WORKLOAD),
    Option("think_steps", 8, k.integer(0, 1 << 30), "steps between a turn's end and the next turn",
           WORKLOAD),
    Option("abort_frac", 0.05, k.fraction, "fraction aborted mid-decode", WORKLOAD),
    Option("retract_frac", 0.1, k.fraction, "fraction retracted mid-decode and readmitted", WORKLOAD),
    Option("seed", 0, k.integer(0, None), "workload seed; the same seed on the same store hits", WORKLOAD),
    Option("lora_adapters", 0, k.integer(0, 1 << 16), "LoRA adapters: each chat is served by one of N "
           "adapters or the base model (drawn uniformly); an adapter's pages are stored under its namespace",
           WORKLOAD),
    Option("cache_salts", 0, k.integer(0, 1 << 16), "salted tenants: each chat belongs to one of N tenants "
           "with a cache_salt or to no tenant (drawn uniformly); a tenant finds only its own pages", WORKLOAD),
    Option("store", None, k.text, "file storage directory (default ./kv-store)", STORAGE),
    Option("storage", None, k.text, "another backend instead of --store: memory, file:DIR, "
           "redis://HOST:PORT/DB, redis+cluster://HOST:PORT, mooncake://HOST:PORT[?options] (retention "
           "options: docs/storage.md)", STORAGE),
    Option("capacity_bytes", None, k.integer(1, None, optional=True), "LRU byte bound of the store "
           "(file, memory, Redis; Mooncake: its global_segment_size option)", STORAGE),
    Option("ttl", None, k.ttl, "Redis / Redis Cluster page expiry, seconds (default: never)", STORAGE),
    Option("key_prefix", None, k.text, "Redis / Redis Cluster key prefix (default: none)", STORAGE),
    Option("reuse", True, k.flag_, "never look up stored prefixes", STORAGE, "--no-reuse", "store_false"),
    Option("warm", False, k.flag_, "serve the workload a second time: it hits the store", STORAGE,
           action="store_true"),
    Option("require_checksum", False, k.flag_, "strict storage: a stored page without a seal (written by "
           "another tool) is a miss", STORAGE, action="store_true"),
    Option("lookup_timeout", 0.5, k.seconds, "deadline of one prefix lookup in storage, seconds; a slower "
           "tier is a miss (and trips its circuit breaker)", STORAGE),
    Option("verify", "128", k.verify, "stored pages read back and compared: N (a sample), all or none",
           STORAGE),
    Option("metrics_port", None, k.integer(1, 65535, optional=True), "serve Prometheus metrics on "
           "http://HOST:PORT/metrics during the run (see docs/metrics.md)", OBSERVE),
    Option("metrics_host", "127.0.0.1", k.host, "address --metrics-port binds (0.0.0.0: every interface)",
           OBSERVE),
    Option("metrics_linger", 0.0, k.number(0.001, 3600, "S", " seconds", zero="none"), "keep serving "
           "/metrics this many seconds after the run's final update, so a scraper gets the final values (needs "
           "--metrics-port)", OBSERVE),
    Option("metrics_push", None, k.push_url, "push the run's final metrics to this Prometheus Pushgateway "
           "(job kv_lifecycle_simulate), e.g. http://127.0.0.1:9091; a failed push is one line on stderr and "
           "exit 2", OBSERVE),
    Option("kv_events", None, k.zmq_endpoint, "publish KV events (BlockStored / BlockRemoved, SGLang's wire "
           "format) on this ZMQ endpoint, bound by the run, e.g. tcp://127.0.0.1:5557", OBSERVE),
    Option("kv_events_replay", None, k.zmq_endpoint, "a ZMQ ROUTER endpoint, bound by the run, from which a "
           "subscriber replays missed event batches (needs --kv-events)", OBSERVE),
    Option("prefill_budget", 2048, k.integer(1), "prompt tokens computed per step at most", cli=None),
    Option("drain_timeout_s", 60.0, k.seconds, "seconds to wait for copies at the end of a pass", cli=None),
    Option("drain_stall_s", 2.0, k.seconds, "at the end of a pass, storage work (writes, prompt backups, "
           "prefix loads) is waited for only while the tier works: it is cut off and counted once the "
           "tier's circuit breaker is open or nothing of it finished for this many seconds", cli=None),
)


class _Methods:
    def torch_dtype_name(self) -> str:
        """The torch dtype's name (``bfloat16`` ...)."""
        return k.DTYPES[self.dtype.lower()]

    def model_name(self) -> str:
        """Names the deployment in storage keys, so pages of another shape never collide."""
        return f"kvsim-L{self.layers}-H{self.heads}-D{self.head_dim}-{self.torch_dtype_name()}"

    @property
    def stride_tokens(self) -> int:
        return self.stride or self.page_size

    @property
    def storage_spec(self) -> str:
        """The storage spec the run opens: ``--storage`` as given (a bare path means ``file:PATH``),
        else ``file:`` + ``--store``."""
        return self._with_retention(self._base_spec)

    @property
    def _base_spec(self) -> str:
        if self.storage is None:
            return f"file:{self.store or './kv-store'}"
        if (self.storage == "memory" or self.storage.startswith(("memory?", "file:"))
                or "://" in self.storage):
            return self.storage
        return f"file:{self.storage}"

    def _with_retention(self, spec: str) -> str:
        """``spec`` with ``--capacity-bytes`` / ``--ttl`` / ``--key-prefix`` as its query options
        (the library, and torch with it, is imported only when one is given)."""
        if self.capacity_bytes is None and self.ttl is None and self.key_prefix is None:
            return spec
        from transfer.storage.retention import with_retention_options

        return with_retention_options(spec, capacity_bytes=self.capacity_bytes, ttl_s=self.ttl,
                                      key_prefix=self.key_prefix)


SimConfig = dataclasses.make_dataclass(
    "SimConfig", [(o.name, object, dataclasses.field(default=o.default)) for o in OPTIONS],
    bases=(_Methods,))
SimConfig.__module__ = __name__
SimConfig.__doc__ = ("Everything a run needs; the fields are ``OPTIONS`` (defaults: a small model that "
                     "finishes in seconds on 2 CPU cores).")


def validate(cfg) -> int:
    """Check ``cfg`` without allocating or generating anything (no torch, no I/O beyond a directory
    probe). Normalises the fields in place (e.g. ``"8"`` -> 8).

    Returns:
        The req-to-token row width a run needs (the largest request, in slots, plus a page).
    Raises:
        ConfigProblem: the first problem found, as one line naming the flag(s).
    """
    for o in OPTIONS:
        setattr(cfg, o.name, o.kind(getattr(cfg, o.name), o.flag))
    _check_combinations(cfg)
    _check_storage(cfg)
    width = check_capacity(cfg)
    check_memory(cfg, width)
    return width


def _check_combinations(cfg) -> None:
    ps, stride = cfg.page_size, cfg.stride_tokens
    if stride % ps:
        raise ConfigProblem(f"--stride {cfg.stride} is not a positive multiple of --page-size {ps}")
    for flag, v in (("--device-tokens", cfg.device_tokens), ("--host-tokens", cfg.host_tokens)):
        if v % ps:
            raise ConfigProblem(f"{flag} {v} is not a multiple of --page-size {ps}")
    if cfg.host_tokens < stride:
        raise ConfigProblem(f"--host-tokens {cfg.host_tokens} cannot hold one offload chunk of {stride} tokens")
    if cfg.abort_frac + cfg.retract_frac > 1.0:
        raise ConfigProblem("--abort-frac + --retract-frac must not exceed 1")
    if cfg.metrics_linger and cfg.metrics_port is None:
        raise ConfigProblem("--metrics-linger needs --metrics-port")
    if cfg.kv_events_replay is not None and cfg.kv_events is None:
        raise ConfigProblem("--kv-events-replay needs --kv-events")
    if cfg.kv_events is not None and cfg.kv_events == cfg.kv_events_replay:
        raise ConfigProblem(f"--kv-events and --kv-events-replay both name {cfg.kv_events!r}")


def _check_storage(cfg) -> None:
    if cfg.store is not None and cfg.storage is not None:
        raise ConfigProblem(f"--store {cfg.store!r} and --storage {cfg.storage!r} both name the storage; give one")
    spec = cfg._base_spec
    if "?" in spec or not (cfg.capacity_bytes is None and cfg.ttl is None and cfg.key_prefix is None):
        spec = _without_retention(cfg)
    if spec.startswith("file:"):
        if len(spec) == 5:
            raise ConfigProblem("--storage file: needs a directory (file:DIR)")
        k.writable_dir(spec[5:], "--store" if cfg.storage is None else "--storage")
    elif spec != "memory":
        from transfer.storage.spec import is_server_spec  # the library's one spec grammar

        if not is_server_spec(spec):
            raise ConfigProblem(f"unknown storage {spec!r} (use a directory, memory, file:DIR, redis://HOST:PORT/DB, "
                                f"redis+cluster://HOST:PORT or mooncake://HOST:PORT)")


def _without_retention(cfg) -> str:
    """The storage spec without its retention options, after checking them (ConfigProblem)."""
    from transfer.errors import StorageConfigError
    from transfer.storage.retention import split_retention_options

    try:
        return split_retention_options(cfg.storage_spec)[0]
    except StorageConfigError as err:
        given = [f for f, v in (("--capacity-bytes", cfg.capacity_bytes), ("--ttl", cfg.ttl),
                                ("--key-prefix", cfg.key_prefix)) if v is not None]
        raise ConfigProblem(f"--storage {cfg._base_spec!r}{' with ' + ', '.join(given) if given else ''}: "
                            f"{err}") from None


def worst_request(cfg) -> tuple[int, int]:
    """(prompt, output) tokens of the longest request the distributions can produce: the last turn
    of a chat whose every turn drew the longest prompt and output."""
    prompt, output = parse_dist(cfg.prompt_len).hi, parse_dist(cfg.output_len).hi
    turns = min(cfg.turns, cfg.requests)
    return cfg.system_prompt + turns * prompt + (turns - 1) * output, output


def check_capacity(cfg) -> int:
    """Raise ConfigProblem if the longest possible request cannot fit the device pool; returns the
    req-to-token row width (that request's slots, page-rounded, plus a page)."""
    ps = cfg.page_size
    prompt, output = worst_request(cfg)
    need = -(-(prompt + output - 1 + cfg.spec_tokens) // ps) * ps
    if need > cfg.device_tokens:
        raise ConfigProblem(
            f"--device-tokens {cfg.device_tokens} is too small for one request: the longest the workload can "
            f"produce needs {need} slots ({prompt} prompt + {output} output + {cfg.spec_tokens} speculative)")
    return need + ps


def pool_bytes(cfg, width: int) -> dict[str, int]:
    """Bytes each pool needs: device KV, host KV, req-to-token rows."""
    per_token = 2 * cfg.layers * cfg.heads * cfg.head_dim * k.DTYPE_BYTES[cfg.torch_dtype_name()]
    return {"device KV pool": (cfg.device_tokens + cfg.page_size) * per_token,
            "host KV pool": cfg.host_tokens * per_token, "req-to-token rows": cfg.rows * width * 4}


def available_memory() -> int | None:
    """Bytes of memory available to this process now (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg, width: int) -> None:
    """Raise ConfigProblem, naming the pool, when the host-side pools exceed available memory."""
    need = pool_bytes(cfg, width)
    if cfg.device != "cpu":
        need.pop("device KV pool")   # on the GPU: checked when it is allocated
    avail = available_memory()
    if avail is None:
        return
    total = sum(need.values())
    if total <= avail:
        return
    name, biggest = max(need.items(), key=lambda kv: kv[1])
    have = f"more than the {avail / 1e9:,.1f} GB of memory available"
    if biggest > avail:
        shape = f"{cfg.layers} layers x K+V x {cfg.heads} heads x {cfg.head_dim} x {cfg.torch_dtype_name()}"
        raise ConfigProblem(f"the {name} needs {biggest / 1e9:,.1f} GB ({shape}), {have}")
    parts = ", ".join(f"{n} {b / 1e9:,.1f} GB" for n, b in need.items())
    raise ConfigProblem(f"the pools need {total / 1e9:,.1f} GB together ({parts}), {have}")
