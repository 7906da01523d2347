"""Node A of tests/test_cross_node.py (a separate process): decode one request through a real stack
and manager storing to Redis, finish it, and report its tokens.

Run: python -m tests.support.cross_node_writer REDIS_URL OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch

from tests.support.decode_driver import DIM, HEADS, LAYERS, MAX_LEN, PS, ROWS, Scheduler
from transfer import build_stack

RID = 11
MODEL = "org/tiny"


def main(url: str, out: str) -> None:
    stack = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 256, 128, ROWS, MAX_LEN,
                        storage=url, model_name=MODEL)
    sch = Scheduler(stack)
    try:
        req = sch.admit(RID, list(range(700, 710)), 3)
        prompt_pages = sch.backup_prompt(req)
        for t in range(13):
            sch.step(40 + t)
        sch.finish(req)
        sch.settle()
        st = stack.offloader.stats()
        result = {
            "rid": RID,
            "tokens": req.origin_input_ids + req.output_ids,
            "kv_tokens": len(req.origin_input_ids) + len(req.output_ids) - 1,
            "prompt_pages": prompt_pages,
            "pages_stored": st.pages_stored,
            "storage_failed": st.storage_failed,
            "released": sch.mgr.stats().released,
        }
    finally:
        sch.mgr.shutdown(force=True)
        stack.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
