"""A reference decode scheduler loop: the example of embedding ``DecodeOffloadManager``.

``kv-lifecycle simulate`` runs it. It plays a busy decode node of a prefill/decode-disaggregated
deployment over the real transfer stack (``transfer.build_stack``: paged device KV pool and
allocator, req-to-token rows, host pool, copy engine, storage, prefix loader) and checks, at the
end, that every slot and row came back and that what was stored is the KV it came from.

How a scheduler embeds the manager (the calls this loop makes, in this order)::

    mgr = DecodeOffloadManager.from_stack(stack, offload_stride=stride)
    while serving:
        mgr.check_offload_progress()            # every iteration: settle copies, release finished
        admit waiting requests                  # a row + slots for prompt (+ speculative slots);
                                                #   a readmitted (retracted) request: mgr.readmit(req)
        one decode step for the running batch   # write the new tokens' KV, append sampled tokens
        for req in batch:
            if req.finished():                  # finished, or aborted: the one release path
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            elif retracted:                     # memory pressure: give the KV back, re-prefill later
                mgr.finalize_release_on_finish(req)
            else:
                mgr.offload_kv_cache(req)       # enqueue the next full chunk, if any
    wait (bounded) until mgr.idle(); mgr.shutdown(); stack.close()

The scheduler never frees a request's slots or row itself: the manager does, exactly once, and
never while a copy still reads them. The loop only learns of a release by ``mgr.state_of(req)``
becoming ``RELEASED`` (then it returns the request's capacity reservation, or re-queues a retracted
request for readmission).

Requests are SGLang-shaped (``rid``, ``origin_input_ids``, ``output_ids``, ``kv.req_pool_idx``,
``kv.kv_committed_len``, ``kv.kv_allocated_len``, ``finished()``); KV exists for
``origin_input_ids + output_ids[:-1]``. With ``spec_tokens = N`` every step keeps
``kv_allocated_len = committed + N`` (speculative over-allocation; those slots are in the row too)
and accepts 1..N+1 tokens.

The KV written for position ``p`` is ``transfer.synthetic_kv(pool, kv_id[p], p)`` where ``kv_id[p]``
is a rolling digest of the tokens up to and including ``p``: like a real model's KV it depends on
the whole prefix, so requests sharing a prefix (a system prompt, earlier chat turns) share KV, the
stored pages named by the hash chain are the same bytes whoever stored them, and every stored page's
expected content can be recomputed for verification.

The workload (token ids, lengths, abort/retract points, arrival steps) is a pure function of the
seed, so a second run on the same store finds what the first stored. Arrival times are counted in
scheduler steps. Admission reserves a request's worst-case pages (prompt + output + speculative
slots) and waits while rows or pages are short, so the allocator never runs dry mid-decode.

Prefix reuse: before computing a prompt the loop looks up its leading pages with the stack's
``PrefixLoader`` and loads the stored ones (checked bit-exact against the synthetic KV); the rest is
computed. Standing in for the prefill node, a background thread backs up the page-aligned prompt
``[0, P)`` to storage (the decode node's manager stores only what it decodes), so later turns of a
chat, and a second pass, hit.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import os
import random
import time
from dataclasses import dataclass, field

DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
VOCAB = 32_000
_KVID_MOD = 2_147_483_647
_KVID_MUL = 1_000_033
_KVID_SEED = 1_234_567


class ConfigProblem(ValueError):
    """An impossible or malformed configuration (the CLI exits 2 with this one-line message)."""


# --- length distributions ------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """A length distribution over ``lo .. hi`` (ints >= 1).

    Spellings: ``N`` (constant), ``LO-HI`` or ``uniform:LO:HI``, ``exp:MEAN[:MAX]`` (exponential,
    capped at MAX, default 4 x MEAN), ``normal:MEAN:STD`` (clipped to 1 .. MEAN + 4 STD).
    """

    kind: str
    a: float
    b: float
    lo: int
    hi: int
    text: str

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if self.kind == "exp":
            x = rng.expovariate(1.0 / self.a)
        else:
            x = rng.gauss(self.a, self.b)
        return max(self.lo, min(self.hi, int(round(x))))


def parse_dist(text: str, what: str = "length") -> Dist:
    """Parse a distribution spelling (see ``Dist``). Raises ConfigProblem."""
    t = str(text).strip().lower()

    def bad(why: str = "") -> ConfigProblem:
        return ConfigProblem(
            f"bad {what} distribution {text!r}{': ' + why if why else ''} "
            "(use N, LO-HI, uniform:LO:HI, exp:MEAN[:MAX] or normal:MEAN:STD)")

    def num(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise bad() from None
        if not math.isfinite(v):
            raise bad("not finite")
        return v

    parts = t.split(":")
    try:
        if len(parts) == 1 and "-" not in t.lstrip("-"):
            n = num(t)
            if n < 1 or n != int(n):
                raise bad("must be a positive integer")
            return Dist("const", n, n, int(n), int(n), text)
        if len(parts) == 1 or parts[0] == "uniform":
            lo_s, hi_s = (parts[1], parts[2]) if len(parts) == 3 else t.split("-", 1) if len(parts) == 1 else (None, None)
            if lo_s is None:
                raise bad()
            lo, hi = num(lo_s), num(hi_s)
            if lo < 1 or hi < lo or lo != int(lo) or hi != int(hi):
                raise bad("need integers 1 <= LO <= HI")
            return Dist("uniform", lo, hi, int(lo), int(hi), text)
        if parts[0] == "exp" and len(parts) in (2, 3):
            mean = num(parts[1])
            cap = num(parts[2]) if len(parts) == 3 else 4 * mean
            if mean < 1 or cap < 1:
                raise bad("mean and cap must be >= 1")
            return Dist("exp", mean, 0.0, 1, int(cap), text)
        if parts[0] == "normal" and len(parts) == 3:
            mean, std = num(parts[1]), num(parts[2])
            if mean < 1 or std < 0:
                raise bad("need MEAN >= 1 and STD >= 0")
            return Dist("normal", mean, std, 1, int(mean + 4 * std), text)
    except ValueError as err:
        if isinstance(err, ConfigProblem):
            raise
        raise bad() from None
    raise bad()


# --- configuration -------------------------------------------------------------------------------


@dataclass
class SimConfig:
    """Everything a run needs. Defaults: a small model that finishes in seconds on 2 CPU cores."""

    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    dtype: str = "bf16"
    page_size: int = 16
    stride: int | None = None
    device_tokens: int = 16_384
    host_tokens: int = 8_192
    rows: int = 32
    max_running: int | None = None
    requests: int = 64
    turns: int = 2
    system_prompt: int = 48
    prompt_len: str = "32-256"
    output_len: str = "32-160"
    arrival_rate: float = 0.5
    think_steps: int = 8
    spec_tokens: int = 0
    abort_frac: float = 0.05
    retract_frac: float = 0.1
    seed: int = 0
    storage: str = "file:kv-store"
    device: str = "cpu"
    reuse: bool = True
    warm: bool = False
    verify: str = "128"
    prefill_budget: int = 2048         # prompt tokens computed per step at most (chunked-prefill-like)
    drain_timeout_s: float = 60.0

    def torch_dtype_name(self) -> str:
        return DTYPES[self.dtype.lower()]

    def model_name(self) -> str:
        """Names the deployment in storage keys, so pages of another shape never collide."""
        return f"kvsim-L{self.layers}-H{self.heads}-D{self.head_dim}-{self.torch_dtype_name()}"


def validate(cfg: SimConfig) -> None:
    """Check flags alone (no torch, no I/O beyond a directory probe). Raises ConfigProblem."""
    for name in ("layers", "heads", "head_dim", "page_size", "device_tokens", "host_tokens", "rows",
                 "requests", "turns"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigProblem(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    for name in ("system_prompt", "think_steps", "spec_tokens", "seed"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigProblem(f"--{name.replace('_', '-')} must be a non-negative integer, got {v!r}")
    if cfg.max_running is not None and cfg.max_running < 1:
        raise ConfigProblem(f"--max-running must be a positive integer, got {cfg.max_running!r}")
    if cfg.dtype.lower() not in DTYPES:
        raise ConfigProblem(f"unknown --dtype {cfg.dtype!r} (choose from {', '.join(sorted(set(DTYPES)))})")
    ps = cfg.page_size
    if cfg.stride is not None and (cfg.stride < 1 or cfg.stride % ps):
        raise ConfigProblem(f"--stride {cfg.stride} is not a positive multiple of --page-size {ps}")
    if cfg.device_tokens % ps:
        raise ConfigProblem(f"--device-tokens {cfg.device_tokens} is not a multiple of --page-size {ps}")
    if cfg.host_tokens % ps:
        raise ConfigProblem(f"--host-tokens {cfg.host_tokens} is not a multiple of --page-size {ps}")
    stride = cfg.stride or ps
    if cfg.host_tokens < stride:
        raise ConfigProblem(f"--host-tokens {cfg.host_tokens} cannot hold one offload chunk of {stride} tokens")
    if not (math.isfinite(cfg.arrival_rate) and cfg.arrival_rate >= 0):
        raise ConfigProblem(f"--arrival-rate must be >= 0 requests per step (0: all at once), got {cfg.arrival_rate}")
    for name in ("abort_frac", "retract_frac"):
        v = getattr(cfg, name)
        if not (0.0 <= v <= 1.0):
            raise ConfigProblem(f"--{name.replace('_', '-')} must lie in 0..1, got {v}")
    if cfg.abort_frac + cfg.retract_frac > 1.0:
        raise ConfigProblem("--abort-frac + --retract-frac must not exceed 1")
    parse_dist(cfg.prompt_len, "--prompt-len")
    parse_dist(cfg.output_len, "--output-len")
    v = cfg.verify.lower()
    if v not in ("all", "none") and not (v.isdigit()):
        raise ConfigProblem(f"--verify must be a count, 'all' or 'none', got {cfg.verify!r}")
    if cfg.device not in ("cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise ConfigProblem(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.storage.startswith("file:"):
        check_store_dir(cfg.storage[5:])
    elif cfg.storage != "memory" and "://" not in cfg.storage:
        raise ConfigProblem(f"unknown storage {cfg.storage!r} (use a directory, memory, or redis://HOST:PORT/DB)")


def check_store_dir(path: str) -> None:
    """Raise ConfigProblem unless ``path`` is (or can be made) a writable directory."""
    path = os.path.expanduser(path)
    if not path:
        raise ConfigProblem("--store needs a directory")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigProblem(f"--store {path!r} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigProblem(f"--store {path!r} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigProblem(f"--store {path!r} cannot be created (no write access to {parent!r})")


# --- the workload --------------------------------------------------------------------------------


@dataclass
class Plan:
    """One request of the workload: a turn of a chat. Pure data, a function of the seed."""

    rid: str
    conv: int
    turn: int
    prompt: list[int]
    output: list[int]          # the tokens it will sample (all of them; fewer if aborted)
    arrival: int               # step (turn 0); later turns arrive think_steps after the previous
    abort_at: int | None = None    # aborted once it holds this many output tokens
    retract_at: int | None = None  # retracted (once) at this many output tokens
    next: "Plan | None" = None

    @property
    def max_slots(self) -> int:
        return len(self.prompt) + len(self.output) - 1


def make_workload(cfg: SimConfig, prefix: str = "") -> list[Plan]:
    """The seed's requests in arrival order of their chats (a chat's turns linked by ``next``)."""
    rng = random.Random(cfg.seed)
    prompt_d, out_d = parse_dist(cfg.prompt_len), parse_dist(cfg.output_len)
    system = [rng.randrange(VOCAB) for _ in range(cfg.system_prompt)]
    n_conv = -(-cfg.requests // cfg.turns)
    plans: list[Plan] = []
    step = 0.0
    made = 0
    for c in range(n_conv):
        if cfg.arrival_rate > 0 and c:
            step += rng.expovariate(cfg.arrival_rate)
        history = list(system)
        prev = None
        for t in range(cfg.turns):
            if made == cfg.requests:
                break
            user = [rng.randrange(VOCAB) for _ in range(prompt_d.sample(rng))]
            prompt = history + user
            n_out = out_d.sample(rng)
            output = [rng.randrange(VOCAB) for _ in range(n_out)]
            plan = Plan(f"{prefix}c{c}t{t}", c, t, prompt, output, int(step))
            u = rng.random()
            if n_out >= 2 and u < cfg.abort_frac:
                plan.abort_at = rng.randint(1, n_out - 1)
                plan.output = output[: plan.abort_at]
            elif n_out >= 2 and u < cfg.abort_frac + cfg.retract_frac:
                plan.retract_at = rng.randint(1, n_out - 1)
            history = prompt + plan.output
            if prev is None:
                plans.append(plan)
            else:
                prev.next = plan
            prev = plan
            made += 1
    return plans


def all_plans(plans: list[Plan]):
    for p in plans:
        while p is not None:
            yield p
            p = p.next


def check_capacity(cfg: SimConfig, plans: list[Plan]) -> int:
    """Raise ConfigProblem if one request cannot fit; returns the req-to-token row width."""
    ps = cfg.page_size
    worst = max(all_plans(plans), key=lambda p: p.max_slots)
    need = -(-(worst.max_slots + cfg.spec_tokens) // ps) * ps
    if need > cfg.device_tokens:
        raise ConfigProblem(
            f"--device-tokens {cfg.device_tokens} is too small for one request: {worst.rid} needs {need} "
            f"slots ({len(worst.prompt)} prompt + {len(worst.output)} output + {cfg.spec_tokens} speculative)")
    return need + ps


# --- requests (SGLang-shaped) --------------------------------------------------------------------


class KVState:
    __slots__ = ("req_pool_idx", "kv_committed_len", "kv_allocated_len")

    def __init__(self) -> None:
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0


class SimRequest:
    """A decode request as SGLang's scheduler holds it, plus the simulator's plan for it."""

    def __init__(self, plan: Plan, kvids) -> None:
        self.rid = plan.rid
        self.origin_input_ids = list(plan.prompt)
        self.output_ids: list[int] = []
        self.kv = KVState()
        self._finished = False
        self.plan = plan
        self.seq = plan.prompt + plan.output
        self.kvids = kvids            # int64 tensor, kv id of every position of seq
        self.pages = 0                # pages of the row backed by allocated slots
        self.reserved = 0             # pages reserved at admission
        self.retracted = False        # retracted once already
        self.readmit = False          # waiting to come back after a retraction
        self.ending = ""              # "finish" | "abort" | "retract" once handed to the manager

    def finished(self) -> bool:
        return self._finished


def kv_ids(tokens: list[int]) -> list[int]:
    """The rolling prefix digest of every position (see the module docstring)."""
    out, h = [], _KVID_SEED
    for t in tokens:
        h = (h * _KVID_MUL + t + 1) % _KVID_MOD
        out.append(h)
    return out


# --- reports -------------------------------------------------------------------------------------


@dataclass
class PassReport:
    name: str = "cold"
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    retracted: int = 0
    readmitted: int = 0
    steps: int = 0
    wall_s: float = 0.0
    tokens_decoded: int = 0
    prompt_tokens_computed: int = 0
    chunks_offloaded: int = 0
    pages_offloaded: int = 0
    bytes_offloaded: int = 0
    offload_gbps: float = 0.0
    chunks_landed: int = 0
    storage_ops: int = 0
    storage_failures: int = 0
    pages_stored: int = 0
    host_short: int = 0
    prefill_backup_pages: int = 0
    prefix_lookups: int = 0
    prefix_pages_looked_up: int = 0
    prefix_pages_hit: int = 0
    prefix_hit_rate: float = 0.0
    prefix_bytes_loaded: int = 0
    prefix_pages_verified: int = 0
    prefix_mismatches: int = 0
    prefix_loads_short: int = 0
    overhead_us_p50: float = 0.0
    overhead_us_p99: float = 0.0
    overhead_us_max: float = 0.0
    rows_admitted: int = 0
    rows_freed: int = 0
    slots_leaked: int = 0
    rows_leaked: int = 0
    host_pages_leaked: int = 0
    manager_leaked: int = 0
    manager_unreleased: int = 0
    double_frees: int = 0
    lifecycle_errors: int = 0
    errors: list[str] = field(default_factory=list)
    verify_pages_stored: int = 0
    verify_sampled: int = 0
    verify_ok: int = 0
    verify_mismatched: int = 0
    verify_missing: int = 0
    drained: bool = True

    def problems(self) -> list[str]:
        out = []
        if self.slots_leaked:
            out.append(f"{self.slots_leaked} device slots leaked")
        if self.rows_leaked:
            out.append(f"{self.rows_leaked} rows leaked")
        if self.host_pages_leaked:
            out.append(f"{self.host_pages_leaked} host pages leaked")
        if self.manager_leaked or self.manager_unreleased:
            out.append(f"manager: {self.manager_leaked} leaked, {self.manager_unreleased} never released")
        if self.double_frees:
            out.append(f"{self.double_frees} double frees")
        if self.lifecycle_errors:
            out.append(f"{self.lifecycle_errors} lifecycle errors")
        if self.rows_freed != self.rows_admitted:
            out.append(f"rows freed {self.rows_freed} != admitted {self.rows_admitted}")
        if self.verify_mismatched:
            out.append(f"{self.verify_mismatched} stored pages differ from their KV")
        if self.verify_missing and not self.storage_failures:
            out.append(f"{self.verify_missing} offloaded pages missing from storage")
        if self.prefix_mismatches:
            out.append(f"{self.prefix_mismatches} loaded prefix pages differ from their KV")
        if not self.drained:
            out.append("copies still in flight after the drain timeout")
        return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(math.ceil(q / 100.0 * len(s))) - 1))
    return s[k]


@dataclass
class Progress:
    """What the progress callback sees (every few steps)."""

    pass_name: str
    step: int
    done: int
    total: int
    running: int
    waiting: int
    inflight_copies: int
    pages_stored: int


# --- the simulator -------------------------------------------------------------------------------


class Simulator:
    """Owns a stack and a manager; ``run_pass`` serves one workload through them.

    Args:
        cfg: the configuration (validated).
        stack: a ``transfer.TransferStack``.
        mgr: the ``DecodeOffloadManager`` over ``stack``.
        progress: optional callback taking a ``Progress``.
    """

    def __init__(self, cfg: SimConfig, stack, mgr, progress=None) -> None:
        import torch

        from transfer.worker import BackgroundWorker

        self.torch = torch
        self.cfg, self.stack, self.mgr = cfg, stack, mgr
        self.ps = cfg.page_size
        self.spec = cfg.spec_tokens
        self.progress = progress
        self.kv = stack.kv_pool
        self.alloc = stack.allocator
        self.rows = stack.req_to_token_pool
        self.host = stack.host_pool
        self.loader = stack.prefix_loader
        self.storage = stack.storage
        self.total_pages = self.alloc.available_size() // self.ps
        self.free0 = self.alloc.available_size()
        self.rows0 = self.rows.available_size()
        self.host0 = self.host.available_size()
        self.max_running = cfg.max_running or self.rows0
        self._backup = BackgroundWorker("prefill-backup", 1)
        self._backup_jobs = 0
        self._load_ids = iter(range(1, 1 << 62))

    # -- helpers -----------------------------------------------------------------------------
    def _timed(self, fn, *args):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            self._step_ns += time.perf_counter_ns() - t0

    def _call(self, rep: PassReport, fn, *args):
        """A manager call, timed; DoubleFree and lifecycle errors are counted, not fatal."""
        from lifecycle.errors import LifecycleError
        from transfer.errors import DoubleFree, InvalidFree

        try:
            return self._timed(fn, *args)
        except DoubleFree as err:
            rep.double_frees += 1
            rep.errors.append(f"DoubleFree: {err}")
        except (LifecycleError, InvalidFree) as err:
            rep.lifecycle_errors += 1
            rep.errors.append(f"{type(err).__name__}: {err}")
        return None

    def _synthetic(self, kvids, positions):
        from transfer.kv_pattern import synthetic_kv

        return synthetic_kv(self.kv, kvids.view(1, 1, -1, 1), positions)

    def _page_bytes(self, kvids, first_pos: int, n_pages: int):
        """Expected page-first bytes ``[n_pages, page_nbytes]`` of pages starting at ``first_pos``."""
        torch = self.torch
        n = n_pages * self.ps
        vals = self._synthetic(kvids[first_pos:first_pos + n], torch.arange(first_pos, first_pos + n))
        k, L, _, H, D = vals.shape
        pages = vals.view(k, L, n_pages, self.ps, H, D).permute(2, 0, 3, 1, 4, 5).contiguous()
        return pages.view(n_pages, -1).view(torch.uint8)

    def _ensure_slots(self, req: SimRequest, allocated: int) -> None:
        need = -(-allocated // self.ps)
        if need > req.pages:
            slots = self.alloc.alloc((need - req.pages) * self.ps)
            if slots is None:  # the reservation makes this impossible
                raise RuntimeError(f"allocator ran dry for {req.rid} despite its reservation")
            row = req.kv.req_pool_idx
            self.rows.req_to_token[row, req.pages * self.ps: need * self.ps] = slots.to(self.torch.int32)
            req.pages = need
        req.kv.kv_allocated_len = allocated

    def _write_kv(self, req: SimRequest, lo: int, hi: int) -> None:
        torch = self.torch
        row = req.kv.req_pool_idx
        for a in range(lo, hi, 1024):
            b = min(hi, a + 1024)
            slots = self.rows.req_to_token[row, a:b].to(torch.int64)
            self.kv.write(slots, self._synthetic(req.kvids[a:b], torch.arange(a, b)))

    # -- admission ---------------------------------------------------------------------------
    def _need_pages(self, req: SimRequest) -> int:
        return -(-(req.plan.max_slots + self.spec) // self.ps)

    def _try_admit(self, req: SimRequest, rep: PassReport, st: dict) -> bool:
        need = self._need_pages(req)
        if st["reserved"] + need > self.total_pages or self.rows.available_size() == 0:
            return False
        row = self.rows.alloc()
        st["reserved"] += need
        req.reserved = need
        req.kv.req_pool_idx = row
        req.pages = 0
        rep.rows_admitted += 1
        if not req.readmit:
            req.output_ids = [req.seq[len(req.origin_input_ids)]]  # the prefill node's first token
        committed = len(req.origin_input_ids) + len(req.output_ids) - 1
        req.kv.kv_committed_len = committed
        if self.cfg.reuse:
            full = committed // self.ps
            rep.prefix_lookups += 1
            rep.prefix_pages_looked_up += full
            staging = min(full, self.host.available_size() // self.ps)  # host pages to stage through
            if staging:
                load_id = next(self._load_ids)
                got = self.loader.start(load_id, req.seq[: full * self.ps], None, staging)
                if got:
                    st["loading"][load_id] = req
                    return True
                if got is None:
                    rep.prefix_loads_short += 1
        self._prefill(req, 0, rep, st)
        return True

    def _loaded(self, done, rep: PassReport, st: dict) -> None:
        torch = self.torch
        req = st["loading"].pop(done.load_id)
        n = done.pages
        row = req.kv.req_pool_idx
        if n:
            slots = done.device_indices
            self.rows.req_to_token[row, : n * self.ps] = slots.to(torch.int32)
            req.pages = n
            rep.prefix_pages_hit += n
            rep.prefix_bytes_loaded += n * self.host.page_nbytes
            got = self.kv.read(slots).view(torch.uint8)
            want = self._synthetic(req.kvids[: n * self.ps], torch.arange(n * self.ps)).view(torch.uint8)
            k, L = got.shape[0], got.shape[1]
            same = (got == want).view(k, L, n, -1).all(-1).all(0).all(0)
            rep.prefix_pages_verified += n
            rep.prefix_mismatches += int((~same).sum())
        self._prefill(req, n * self.ps, rep, st)

    def _prefill(self, req: SimRequest, loaded: int, rep: PassReport, st: dict) -> None:
        """Compute the KV not loaded, back up the prompt's pages, and start decoding (or readmit)."""
        committed = req.kv.kv_committed_len
        self._ensure_slots(req, committed + self.spec)
        self._write_kv(req, loaded, committed)
        rep.prompt_tokens_computed += committed - loaded
        st["prefill"] += committed - loaded
        if not req.readmit:
            p_pages = len(req.origin_input_ids) // self.ps
            first = loaded // self.ps
            if p_pages > first:
                self._start_backup(req, first, p_pages, rep)
        else:
            req.readmit = False
            rep.readmitted += 1
            self._call(rep, self.mgr.readmit, req)
        st["running"].append(req)

    def _start_backup(self, req: SimRequest, first: int, last: int, rep: PassReport) -> None:
        import hashing

        keys = hashing.page_hashes(req.seq[: last * self.ps], self.ps)
        kvids = req.kvids
        storage = self.storage

        def job() -> int:
            have = storage.batch_exists(keys)
            start = max(first, have)
            if start >= last:
                return 0
            pages = self._page_bytes(kvids, start * self.ps, last - start)
            ok = storage.batch_set(keys[start:last], [pages[i] for i in range(last - start)])
            return sum(ok)

        self._backup_jobs += 1
        self._backup.submit(req.rid, job)

    def _poll_backups(self, rep: PassReport) -> None:
        for done in self._backup.poll():
            self._backup_jobs -= 1
            if done.error is None:
                rep.prefill_backup_pages += done.value
            else:
                rep.errors.append(f"prefill backup of {done.tag}: {done.error!r}")

    # -- the loop ----------------------------------------------------------------------------
    def _new_request(self, plan: Plan) -> SimRequest:
        ids = kv_ids(plan.prompt + plan.output)
        return SimRequest(plan, self.torch.tensor(ids, dtype=self.torch.int64))

    def run_pass(self, plans: list[Plan], name: str = "cold") -> PassReport:
        """Serve ``plans`` until every request is done and released; then drain, check, verify."""
        torch = self.torch
        mgr = self.mgr
        rep = PassReport(name=name)
        rng = random.Random(self.cfg.seed * 7919 + 17)
        total = sum(1 for _ in all_plans(plans))
        rep.requests = total
        arrivals = collections.deque(sorted(plans, key=lambda p: p.arrival))
        later: list[tuple[int, Plan]] = []       # (step, plan): next turns of chats
        waiting: collections.deque[SimRequest] = collections.deque()
        st = {"running": [], "loading": {}, "reserved": 0, "prefill": 0}
        draining: list[SimRequest] = []          # handed to the manager, not yet RELEASED
        stored_segments: list[tuple] = []        # (seq, kvids, P, inc) per release
        overhead: list[float] = []
        off0 = self.stack.offloader.stats()
        mgr0 = mgr.stats()
        done = 0
        step = 0
        t_start = time.perf_counter()
        last_progress = 0.0
        while done < total:
            step += 1
            self._step_ns = 0
            # arrivals (chat turns and new chats)
            while arrivals and arrivals[0].arrival <= step:
                waiting.append(self._new_request(arrivals.popleft()))
            if later:
                due = [p for s, p in later if s <= step]
                if due:
                    later = [(s, p) for s, p in later if s > step]
                    waiting.extend(self._new_request(p) for p in due)
            # every iteration
            self._call(rep, mgr.check_offload_progress)
            self._poll_backups(rep)
            still = []
            for req in draining:
                if mgr.state_of(req) is not _released():
                    still.append(req)
                    continue
                st["reserved"] -= req.reserved
                req.reserved = 0
                if req.kv.req_pool_idx is None:
                    rep.rows_freed += 1
                prog = mgr.progress_of(req)
                if prog is not None and prog.inc_len:
                    stored_segments.append((req.seq, req.kvids, len(req.origin_input_ids) // self.ps * self.ps,
                                            prog.inc_len))
                if req.ending == "retract":
                    req.readmit = True
                    req.ending = ""
                    waiting.appendleft(req)
                else:
                    done += 1
                    if req.plan.next is not None:
                        later.append((step + self.cfg.think_steps, req.plan.next))
            draining = still
            # finished prefix loads
            for load in self.loader.finished():
                self._loaded(load, rep, st)
            # admission
            st["prefill"] = 0
            while (waiting and len(st["running"]) + len(st["loading"]) < self.max_running
                   and st["prefill"] < self.cfg.prefill_budget):
                if not self._try_admit(waiting[0], rep, st):
                    break
                waiting.popleft()
            # one decode step
            running = st["running"]
            if running:
                slot_parts, id_parts, pos_parts = [], [], []
                for req in running:
                    c = req.kv.kv_committed_len
                    left = len(req.seq) - len(req.origin_input_ids) - len(req.output_ids)
                    if req.plan.abort_at is not None:
                        left = min(left, req.plan.abort_at - len(req.output_ids))
                    if not req.retracted and req.plan.retract_at is not None:
                        left = min(left, req.plan.retract_at - len(req.output_ids))
                    a = min(1 + (rng.randint(0, self.spec) if self.spec else 0), left)
                    if a <= 0:
                        continue
                    self._ensure_slots(req, c + a + self.spec)
                    row = req.kv.req_pool_idx
                    slot_parts.append(self.rows.req_to_token[row, c:c + a])
                    id_parts.append(req.kvids[c:c + a])
                    pos_parts.append(torch.arange(c, c + a))
                    n_out = len(req.output_ids)
                    base = len(req.origin_input_ids)
                    req.output_ids.extend(req.seq[base + n_out: base + n_out + a])
                    req.kv.kv_committed_len = c + a
                    rep.tokens_decoded += a
                if slot_parts:
                    slots = torch.cat(slot_parts).to(torch.int64)
                    self.kv.write(slots, self._synthetic(torch.cat(id_parts), torch.cat(pos_parts)))
                keep = []
                for req in running:
                    n_out = len(req.output_ids)
                    plan = req.plan
                    if n_out >= len(plan.output):
                        req._finished = True
                        if plan.abort_at is not None:
                            req.ending = "abort"
                            rep.aborted += 1
                            self._call(rep, mgr.finalize_release_on_finish, req)
                        else:
                            req.ending = "finish"
                            rep.finished += 1
                            if not self._call(rep, mgr.offload_kv_cache, req):
                                self._call(rep, mgr.finalize_release_on_finish, req)
                        draining.append(req)
                    elif not req.retracted and plan.retract_at is not None and n_out >= plan.retract_at:
                        req.retracted = True
                        req.ending = "retract"
                        rep.retracted += 1
                        self._call(rep, mgr.finalize_release_on_finish, req)
                        draining.append(req)
                    else:
                        self._call(rep, mgr.offload_kv_cache, req)
                        keep.append(req)
                st["running"] = keep
            overhead.append(self._step_ns / 1000.0)
            if not running and not st["loading"] and not draining and not waiting:
                # idle: jump the clock to the next arrival
                nxt = ([arrivals[0].arrival] if arrivals else []) + [s for s, _ in later]
                if nxt:
                    step = max(step, min(nxt) - 1)
            elif not running:
                time.sleep(0.0002)  # only waiting on copies or loads
            now = time.perf_counter()
            if self.progress is not None and now - last_progress > 0.1:
                last_progress = now
                s = mgr.stats()
                self.progress(Progress(name, step, done, total, len(st["running"]), len(waiting),
                                       s.inflight_writes, self.stack.offloader.stats().pages_stored))
            if now - t_start > 3600:
                raise RuntimeError("simulation made no progress for an hour")
        # drain: every copy landed, every storage op finished, every backup written
        deadline = time.perf_counter() + self.cfg.drain_timeout_s
        while True:
            self._step_ns = 0
            self._call(rep, mgr.check_offload_progress)
            self._poll_backups(rep)
            if mgr.idle() and self._backup_jobs == 0 and self.loader.idle():
                break
            if time.perf_counter() > deadline:
                rep.drained = False
                break
            time.sleep(0.001)
        rep.wall_s = time.perf_counter() - t_start
        rep.steps = step
        # what the manager and offloader did in this pass
        s, off = mgr.stats(), self.stack.offloader.stats()
        rep.chunks_offloaded = s.chunks_enqueued - mgr0.chunks_enqueued
        rep.pages_offloaded = s.pages_enqueued - mgr0.pages_enqueued
        rep.bytes_offloaded = rep.pages_offloaded * self.host.page_nbytes
        rep.offload_gbps = rep.bytes_offloaded / rep.wall_s / 1e9 if rep.wall_s else 0.0
        rep.chunks_landed = s.chunks_landed - mgr0.chunks_landed
        rep.storage_ops = off.storage_ops - off0.storage_ops
        rep.storage_failures = off.storage_failed - off0.storage_failed
        rep.pages_stored = off.pages_stored - off0.pages_stored
        rep.host_short = s.host_short - mgr0.host_short
        rep.prefix_hit_rate = (rep.prefix_pages_hit / rep.prefix_pages_looked_up
                               if rep.prefix_pages_looked_up else 0.0)
        rep.overhead_us_p50 = percentile(overhead, 50)
        rep.overhead_us_p99 = percentile(overhead, 99)
        rep.overhead_us_max = max(overhead, default=0.0)
        # leaks: every slot, row and host page back; the manager holds nothing unreleased
        rep.slots_leaked = self.free0 - self.alloc.available_size()
        rep.rows_leaked = self.rows0 - self.rows.available_size()
        rep.host_pages_leaked = (self.host0 - self.host.available_size()) // self.ps
        waiting.clear()
        st.clear()
        draining.clear()
        gc.collect()
        s = mgr.stats()
        rep.manager_leaked = s.leaked - mgr0.leaked
        rep.manager_unreleased = s.tracked
        try:
            self.alloc.check_integrity()
        except Exception as err:  # noqa: BLE001 - reported, not raised
            rep.errors.append(f"allocator integrity: {err}")
            rep.lifecycle_errors += 1
        self._verify(stored_segments, rep)
        return rep

    # -- verification ------------------------------------------------------------------------
    def _verify(self, segments: list[tuple], rep: PassReport) -> None:
        """Read a sample of the pages the manager offloaded back from storage; compare bytes."""
        import hashing

        torch = self.torch
        pages: dict[str, tuple] = {}
        for seq, kvids, p, inc in segments:
            hashes = hashing.page_hashes(seq[: p + inc], self.ps)
            for i in range(p // self.ps, (p + inc) // self.ps):
                pages.setdefault(hashes[i], (kvids, i * self.ps))
        rep.verify_pages_stored = len(pages)
        mode = self.cfg.verify.lower()
        keys = sorted(pages)
        if mode == "none":
            keys = []
        elif mode != "all":
            random.Random(self.cfg.seed).shuffle(keys)
            keys = keys[: int(mode)]
        rep.verify_sampled = len(keys)
        batch = max(1, min(64, self.host.available_size() // self.ps))
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            host = self.host.alloc(len(part) * self.ps)
            if host is None:
                bufs = [torch.empty(self.host.page_nbytes, dtype=torch.uint8) for _ in part]
            else:
                hp = self.host.pages_of(host).tolist()
                bufs = [self.host.page_bytes(p) for p in hp]
            try:
                got = self.storage.batch_get(part, bufs)
                for key, ok, buf in zip(part, got, bufs):
                    if not ok:
                        rep.verify_missing += 1
                        continue
                    kvids, pos = pages[key]
                    want = self._page_bytes(kvids, pos, 1)[0]
                    if torch.equal(buf, want):
                        rep.verify_ok += 1
                    else:
                        rep.verify_mismatched += 1
            finally:
                if host is not None:
                    self.host.free(host)

    def close(self) -> None:
        self._backup.close()


def _released():
    from lifecycle.states import State

    return State.RELEASED


# --- running it ----------------------------------------------------------------------------------


@dataclass
class RunReport:
    config: dict
    passes: list[PassReport]
    storage: dict
    wall_s: float

    @property
    def problems(self) -> list[str]:
        out = []
        for p in self.passes:
            out += [f"{p.name}: {x}" for x in p.problems()]
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "wall_s": round(self.wall_s, 3),
            "config": self.config,
            "storage": self.storage,
            "passes": [dataclasses.asdict(p) for p in self.passes],
        }


def prepare(cfg: SimConfig) -> tuple[list[Plan], int]:
    """Validate ``cfg`` and make its workload; no torch, no work. Raises ConfigProblem."""
    validate(cfg)
    plans = make_workload(cfg)
    return plans, check_capacity(cfg, plans)


def build(cfg: SimConfig, max_len: int):
    """The stack and manager for ``cfg`` (after ``prepare``). Storage errors propagate."""
    import torch

    from lifecycle.manager import DecodeOffloadManager
    from transfer import build_stack

    stack = build_stack(
        cfg.layers, cfg.heads, cfg.head_dim, getattr(torch, cfg.torch_dtype_name()), cfg.page_size,
        cfg.device_tokens, cfg.host_tokens, cfg.rows, max_len, storage=cfg.storage, device=cfg.device,
        model_name=cfg.model_name(),
    )
    try:
        mgr = DecodeOffloadManager.from_stack(stack, offload_stride=cfg.stride)
    except BaseException:
        stack.close()
        raise
    return stack, mgr


def run(cfg: SimConfig, stack, mgr, plans: list[Plan], progress=None) -> RunReport:
    """Serve the workload (twice with ``cfg.warm``), then shut the manager and stack down."""
    t0 = time.perf_counter()
    sim = Simulator(cfg, stack, mgr, progress)
    passes = []
    try:
        passes.append(sim.run_pass(plans, "cold" if cfg.warm else "run"))
        if cfg.warm:
            passes.append(sim.run_pass(make_workload(cfg, prefix="w-"), "warm"))
    finally:
        sim.close()
        deadline = time.perf_counter() + cfg.drain_timeout_s
        while not mgr.idle() and time.perf_counter() < deadline:
            mgr.check_offload_progress()
            time.sleep(0.001)
        mgr.shutdown(force=not mgr.idle())
        stack.close()
    st = stack.storage.stats()
    storage = {"spec": cfg.storage, "pages": st.pages, "bytes": st.bytes, "stored": st.stored,
               "skipped": st.skipped, "hits": st.hits, "misses": st.misses, "errors": st.errors,
               "evictions": st.evictions}
    return RunReport(dataclasses.asdict(cfg), passes, storage, time.perf_counter() - t0)
