"""The decode attention kernels alone (K.flash_attention for an f16 cache, K.flash_attention_q
for q8_0 / q4_0 / mixed): one query over 4096 cells, 24 layers' caches cycled so that they
come from memory as in a real step, on the shapes of qwen2.5-coder:0.5b (14 heads, 2 kv, d 64),
1.5b (12, 2, 128) and gemma3:270m (4, 1, 256: one work item per query below 512 cells); min
and median ms per layer. The outputs go to /tmp/fa_TAG.npz, so two trees (SRC=...) can be
checked for equal bits. numbat against itself: the llama.cpp ratios at
depth are bench/depth_compare.py's.

    python bench/attention_kernel.py TAG
    TYPES=q4_0/q4_0,f16/q8_0 SRC=/path/to/other/tree python bench/attention_kernel.py TAG2
    CELLS=4096,16384 python bench/attention_kernel.py TAG3
"""
import sys, time, os
sys.path.insert(0, os.environ.get("SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))
import runner.env  # noqa
import numpy as np, numba
from runner.backends import kernels as K
from runner.kv_cache import _kv_arrays
def setup(n_head, n_kv, d, cells, types=("f16","f16"), seed=0):
    rng = np.random.default_rng(seed)
    pages = -(-cells // 64)
    k, v = _kv_arrays(n_kv, d, pages, types)
    kk = rng.standard_normal((cells, n_kv, d)).astype(np.float32) * 2
    vv = rng.standard_normal((cells, n_kv, d)).astype(np.float32)
    slots = np.arange(cells)
    if types == ("f16", "f16"):
        q0 = np.zeros((cells, n_head, d), np.float32)
        K.rope_store(q0, kk, vv, slots.astype(np.int64), np.float32(1), np.float32(0), np.ones(d // 2, np.float32), False, slots, k, v, np.float32(1), False, True)
    else:
        codes = {"f16": K.KV_F16, "q8_0": K.KV_Q8_0, "q4_0": K.KV_Q4_0}
        K.store_kv(kk, vv, slots, k, v, codes[types[0]], codes[types[1]])
    kpos = np.full(pages * 64, -1, np.int64); kpos[:cells] = np.arange(cells)
    q = rng.standard_normal((1, n_head, d)).astype(np.float32)
    tables = np.arange(pages, dtype=np.int64)[None]
    scratch = np.zeros((numba.config.NUMBA_NUM_THREADS, K.attention_scratch(pages * 64, d, n_head // n_kv)), np.float32)
    return q, k, v, kpos, tables, np.array([cells], np.int64), scratch
def run(shape, cells, types, runs, layers=24):
    n_head, n_kv, d = shape
    q, k, v, kpos, tables, ss, scratch = setup(n_head, n_kv, d, cells, types)
    ks = [setup(n_head, n_kv, d, cells, types, seed=i)[1:3] for i in range(layers)]
    out = np.zeros_like(q); qpos = np.array([cells - 1], np.int64); qseq = np.zeros(1, np.int64)
    sc = np.float32(d ** -0.5)
    if types == ("f16", "f16"):
        kern, item = K.flash_attention(q.shape[2], False), K.fa_items(q.shape[2], False).address
        f = lambda: kern(q, qpos, qseq, np.array([K.FA_ONE], np.int64), k, v, kpos, tables, ss, 0, sc, out, scratch, numba.get_num_threads(), item)
    else:
        codes = {"f16": K.KV_F16, "q8_0": K.KV_Q8_0, "q4_0": K.KV_Q4_0}
        # the thread count, where the tree's kernel takes it (its head split, session 29)
        nth = (numba.get_num_threads(),) if "threads" in K.flash_attention_q.py_func.__code__.co_varnames else ()
        f = lambda: K.flash_attention_q(q, qpos, qseq, k, v, kpos, tables, ss, 0, sc, out, scratch, *nth, codes[types[0]], codes[types[1]])
    f()
    o = out.copy()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        for k, v in ks:
            f()
        ts.append((time.perf_counter() - t) / layers)
    return (np.min(ts), np.median(ts)), o
if __name__ == "__main__":
    tag = sys.argv[1]
    res = {}
    for name, shape in (("0.5b", (14, 2, 64)), ("1.5b", (12, 2, 128)), ("gemma3", (4, 1, 256))):
        for types in [tuple(x.split("/")) for x in os.environ.get("TYPES", "f16/f16,q8_0/q8_0").split(",")]:
            for cells in [int(c) for c in os.environ.get("CELLS", "4096").split(",")]:
                t, o = run(shape, cells, types, 15 if types[0] == "f16" else 5)
                print(f"{tag} {name} {types[0]} {cells}: min {t[0]*1e3:.3f} med {t[1]*1e3:.3f} ms", flush=True)
                res[f"{name}_{types[0]}_{cells}"] = o
    np.savez(f"/tmp/fa_{tag}.npz", **res)
