"""The vLLM load path's costs (``lifecycle.integrations.vllm.lookup`` / ``load``), on this machine:

* the scheduler thread's cost of one ``get_num_new_matched_tokens`` ask for a 4097-token prompt —
  the first (copies the loadable tokens, queues the lookup), one while the lookup is pending (a hung
  tier here: it never answers until released), one answered;
* one 256-page load (a Llama-8B-like rank: 32 layers, 8 KV heads of 128, bf16: 2 MiB pages) from
  the file tier (warm page cache) into CPU blocks of vLLM's head-major layout.

    .venv/bin/python bench/bench_vllm_load.py
"""
import shutil
import time, threading, tempfile, torch
from types import SimpleNamespace
from lifecycle.integrations.vllm.lookup import LoadPlanner
from lifecycle.integrations.vllm.load import LoadJob, LoadWorker
from lifecycle.integrations.vllm.layout import VllmKVLayout
from lifecycle_tools.testkit.vllm_kv import make_kv_caches
from transfer.storage.file import FileStorage
from transfer.stack import page_format
import hashing
bs=16; L,H,D=32,8,128   # a Llama-8B-like rank: 32 layers, 8 KV heads, 128 dim, bf16 -> 2 MiB pages
caches=make_kv_caches("rows", L, 300, H, bs, D, torch.bfloat16)
lay=VllmKVLayout.from_kv_caches(caches, bs)
d=tempfile.mkdtemp(prefix="bench-vllm-load-")
st=FileStorage(d, "_m_0_1", lay.page_nbytes, page_format=page_format(lay.host_pool(bs, pin=False)))
tokens=list(range(1, 4096+2))
names=hashing.page_hashes(tokens, bs)
page=torch.zeros(lay.page_nbytes, dtype=torch.uint8)
st.batch_set(names, [page]*len(names))
gate=threading.Event()
class G:
    suffix=st.suffix; page_nbytes=st.page_nbytes
    def batch_exists(self, k): gate.wait(); return st.batch_exists(k)
p=LoadPlanner(G(), bs)
reqs=[SimpleNamespace(request_id=f"r{i}", all_token_ids=tokens, num_tokens=len(tokens), cache_salt=None, lora_request=None, mm_features=[]) for i in range(50)]
t=time.perf_counter(); [p.matched_tokens(r, 0) for r in reqs]; first=(time.perf_counter()-t)/50
t=time.perf_counter()
for _ in range(20): [p.matched_tokens(r, 0) for r in reqs]
again=(time.perf_counter()-t)/1000
gate.set()
while p.pending(): time.sleep(0.001)
t=time.perf_counter(); ans=[p.matched_tokens(r, 0) for r in reqs]; answered=(time.perf_counter()-t)/50
print(f"scheduler thread per ask, 4097-token prompt: first (queues the lookup) {first*1e6:.0f} us, pending {again*1e6:.1f} us, answered {answered*1e6:.1f} us; answer {ans[0]}")
w=LoadWorker(lay, st, threads=2)
p.after_alloc(reqs[0], SimpleNamespace(get_block_ids=lambda: (list(range(256)),)), 256*bs)
jobs=p.take_load_jobs()
t=time.perf_counter(); w.start(jobs)
while not w.finished_recving(): time.sleep(0.0005)
dt=time.perf_counter()-t
print(f"load of 256 pages x {lay.page_nbytes/2**20:.0f} MiB from the file tier (page cache) into CPU blocks: {dt:.2f} s, {256*lay.page_nbytes/dt/2**30:.2f} GiB/s; errors {w.load_error_block_ids()}")
w.close(); p.close(); st.close()
shutil.rmtree(d)
