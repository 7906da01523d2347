"""``kv-lifecycle simulate``: a reference decode scheduler over the real transfer stack.

It plays a busy decode node of a prefill/decode-disaggregated deployment (``transfer.build_stack``:
paged device KV pool and allocator, req-to-token rows, host pool, copy engine, storage, prefix
loader), embeds ``DecodeOffloadManager`` the way a scheduler should (``scheduler``), and checks at
the end that every slot and row came back and that what was stored is the KV it came from.

Modules: ``config`` (the options, declared once), ``dist`` and ``workload`` (the synthetic chats,
made lazily), ``state`` (the requests and a pass's state), ``admission`` (rows, prefix loads,
prefill, prompt backups), ``scheduler`` (the loop), ``kvdata`` (synthetic KV), ``verify`` (sampled
read-back), ``tally`` and ``report`` (figures and the summary), ``runner`` (build, run, shut down).
Importing this package loads no torch; ``build``/``run`` do.
"""

from lifecycle_tools.simulate.config import OPTIONS, Option, SimConfig, check_capacity, validate
from lifecycle_tools.simulate.dist import MAX_LEN, Dist, parse_dist
from lifecycle_tools.simulate.errors import ConfigProblem
from lifecycle_tools.simulate.report import PassReport, Progress, RunReport, format_summary
from lifecycle_tools.simulate.runner import build, prepare, run, shut_down
from lifecycle_tools.simulate.workload import Plan, all_plans, iter_chats, kv_ids, make_workload

__all__ = [
    "MAX_LEN", "OPTIONS", "ConfigProblem", "Dist", "Option", "PassReport", "Plan", "Progress", "RunReport",
    "SimConfig", "Simulator", "all_plans", "build", "check_capacity", "format_summary", "iter_chats", "kv_ids",
    "make_workload", "parse_dist", "prepare", "run", "shut_down", "validate",
]


def __getattr__(name):  # the loop needs torch: imported on first use
    if name == "Simulator":
        from lifecycle_tools.simulate.scheduler import Simulator

        return Simulator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
