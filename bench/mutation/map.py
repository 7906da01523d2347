"""What the mutation campaign mutates, and which test files each group of modules runs against.

Each group is one ``mutmut run`` over its own snapshot: the modules matched by ``mutate`` are
mutated, and only the test files matched by ``tests`` are run (mutmut then narrows further, per
mutated function, to the tests that call it). Globs are expanded in the snapshot, so tests added
later are picked up when they match.

Left out of every group, with the reason:

- tests that start other interpreters (``test_tp``, ``test_faults_kill``, ``test_cross_node``,
  ``test_mooncake_cross_process``, ``test_logging``, ``test_sglang_tp``, one ``test_sglang_install`` test): the children import the library afresh, outside mutmut's
  per-mutant switch, and each costs seconds of interpreter start per mutant;
- ``test_model_check`` (35 s, exhaustive) and ``test_properties`` (hypothesis state machine):
  too slow per mutant; what they check is asserted directly by the manager's unit tests;
- Mooncake (``transfer/storage/mooncake/``) is its own group, run against a real ``mooncake_master``
  that its test fixtures start (``pip install -e '.[mooncake]'`` + Debian ``libibverbs1``). Its
  mutants run through mutmut's fork server (``isolation``): a child forked from a process that has
  used a Mooncake client hangs on its first store call, while one forked from a server that only
  imported the tests starts its own master and clients. Each child starts that master, which the
  stats run times into one test only, so ``timeout_constant`` (seconds added to every mutant's
  measured test time before the multiplier) is raised: a slow start is not reported as a timeout,
  i.e. as a kill;
- ``lifecycle/integrations``: SGLang glue, mutated as its own group against its own tests.
"""

from __future__ import annotations

# per group: "mutate" and "tests" (globs), optionally "exclude" (globs), "isolation" (mutmut's
# process_isolation: "fork", its default, or "forkserver") and "timeout_constant" (seconds)
GROUPS: dict[str, dict] = {
    "hashing": {
        "mutate": ["hashing/*.py"],
        "tests": ["tests/hashing/test_*.py"],
    },
    "lifecycle": {
        "mutate": ["lifecycle/*.py"],
        "tests": ["tests/lifecycle/test_*.py"],
    },
    "lifecycle.integrations": {
        "mutate": ["lifecycle/integrations/*.py", "lifecycle/integrations/*/*.py"],
        "tests": ["tests/integrations/test_*.py"],
    },
    "transfer.allocator": {
        "mutate": ["transfer/allocator.py", "transfer/page_set.py", "transfer/indices.py",
                   "transfer/req_pool.py", "transfer/host_pool.py", "transfer/kv_pool.py"],
        "tests": ["tests/transfer/test_allocator.py", "tests/transfer/test_indices.py",
                  "tests/transfer/test_*pool*.py", "tests/transfer/test_page_set.py"],
    },
    "transfer.offloader": {
        "mutate": ["transfer/host_offloader.py", "transfer/offloader.py", "lifecycle_tools/testkit/memory.py",
                   "transfer/copy_engine.py", "transfer/gather.py", "transfer/worker.py",
                   "transfer/stack.py", "transfer/shutdown.py", "lifecycle_tools/testkit/kv_pattern.py",
                   "transfer/errors.py", "transfer/log.py"],
        "tests": ["tests/transfer/test_host_offloader.py", "tests/transfer/test_copy_engine.py",
                  "tests/transfer/test_faults.py", "tests/transfer/test_stack.py",
                  "tests/transfer/test_end_to_end.py", "tests/transfer/test_gather*.py",
                  "tests/transfer/test_worker*.py", "tests/transfer/test_shutdown*.py",
                  "tests/transfer/test_device_indices.py", "tests/tools/test_kv_pattern.py",
                  "tests/transfer/test_log.py"],
    },
    "transfer.storage": {
        "mutate": ["transfer/storage/*.py", "transfer/storage/redis/*.py", "transfer/prefix.py"],
        "tests": ["tests/transfer/test_storage.py", "tests/transfer/test_file_storage*.py",
                  "tests/transfer/test_redis_*.py",
                  "tests/transfer/test_integrity.py", "tests/transfer/test_breaker.py",
                  "tests/transfer/test_prefix*.py", "tests/transfer/test_lru*.py",
                  "tests/transfer/test_storage_checks.py", "tests/transfer/test_writers.py",
                  "tests/transfer/test_identity.py", "tests/transfer/test_layout.py",
                  "tests/transfer/test_retention.py", "tests/transfer/test_log.py"],
    },
    "transfer.mooncake": {
        "mutate": ["transfer/storage/mooncake/*.py"],
        "tests": ["tests/transfer/test_mooncake_*.py"],
        "isolation": "forkserver",
        "timeout_constant": 10.0,
    },
    "transfer.kv_events": {
        "mutate": ["transfer/kv_events/*.py"],
        "tests": ["tests/transfer/test_kv_events_*.py"],
    },
}

NEVER_MUTATE = ["**/__main__.py"]  # at any depth

SLOW_OR_MULTIPROCESS_TESTS = [
    "tests/lifecycle/test_model_check.py", "tests/lifecycle/test_properties.py",
    "tests/lifecycle/test_tp.py", "tests/transfer/test_faults_kill.py",
    "tests/transfer/test_cross_node.py", "tests/transfer/test_mooncake_cross_process.py",
    "tests/lifecycle/test_logging.py", "tests/integrations/test_sglang_tp.py",
]

# single tests that start a child interpreter, inside files that are otherwise kept
DESELECT = ["tests/integrations/test_sglang_install.py::test_importing_the_integration_imports_no_sglang"]

LIBRARY = ["lifecycle", "transfer", "hashing"]
ALSO_COPY = ["lifecycle_tools", "tests", "bench", "docs", "diagrams", "README.md"]  # importable or read by tests, never mutated
