"""Dev tool: run ggml's own CPU ops (the llama.cpp build on this machine) on numpy data
through ctypes, to compare numbat's kernels with llama.cpp operation by operation.

Not collected by pytest (no test_ prefix, no test_ functions); imports only numpy + stdlib.

    python -m tests.oracle.ggml_ops          # self-check (shapes/layouts, not bit-exactness)

API
    flash_attn(q, k, v, mask, scale, n_threads=2, k_type="f16", v_type="f16", ...) -> out
        q (n_tokens, n_head, d) f32; k, v (n_kv, n_head_kv, d) f32 values (or uint8 raw rows of
        k_type/v_type, shape (n_kv, n_head_kv, row_bytes), to feed stored bytes unchanged);
        mask (n_tokens, n_kv) f32 of 0/-inf (or None) -> out (n_tokens, n_head, d) f32.
    stored(x, type, method="set_rows") -> uint8 (..., row_bytes): the bytes ggml stores for x.
    dequantize(raw, type) -> f32 (..., d): numpy decoding of those bytes (f16, q8_0, q4_0).

How the graph mirrors llama.cpp (src/llama-graph.cpp build_attn_mha, src/llama-kv-cache.cpp):
  * q is a [d, n_head, n_tokens] f32 tensor (exactly numpy's (n_tokens, n_head, d) memory),
    permuted (0,2,1,3) to [d, n_tokens, n_head] (a non-contiguous view, as in llama.cpp).
  * The K/V cache is a 2-D [d*n_head_kv, n_kv] tensor of the cache type. Quantized types are
    written the way llama_kv_cache::cpy_k/cpy_v do it: ggml_set_rows from an f32
    [d*n_head_kv, n_tokens] tensor, which runs the CPU type traits' from_float
    (ggml-cpu/ops.cpp ggml_compute_forward_set_rows_impl). "f16" uses numpy astype(float16)
    bits (RNE, identical to the F16C ggml_cpu_fp32_to_fp16 that set_rows would use; the
    self-check verifies it). The cache is then viewed as llama_kv_cache::get_k/get_v do:
    view_4d [d, n_head_kv, n_kv, 1] with nb1=row(d), nb2=row(d*n_head_kv), permuted
    (0,2,1,3) to [d, n_kv, n_head_kv]; V is not transposed (flash attention).
  * mask is f16 [n_kv, n_tokens, 1, 1]; this ggml version has no GGML_KQ_MASK_PAD, and
    llama.cpp builds the mask with exactly n_tokens rows, so no padding is added.
  * ggml_prec_set_acc(fa, GGML_PREC_F32) as llama.cpp does (the CPU op treats DEFAULT and F32
    the same). Result [d, n_head, n_tokens] f32 -> numpy (n_tokens, n_head, d).
  * Computed with ggml_graph_plan + ggml_graph_compute(n_threads), which is exactly what
    ggml_graph_compute_with_ctx does (plan, work buffer, compute) except that the work buffer
    is a numpy array and cplan.use_ref can be set (use_ref=True forces the scalar
    one-chunk kernel: no tiled GEMM path, no split-KV decode path).
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

LIB_DIR = os.environ.get(
    "NUMBAT_GGML_LIB", "/work/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")

TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
_I64 = 27              # GGML_TYPE_I64
_PREC_F32 = 10         # GGML_PREC_F32
_STATUS_SUCCESS = 0
# block size (elements), bytes per block
_BLOCK = {"f32": (1, 4), "f16": (1, 2), "q4_0": (32, 18), "q8_0": (32, 34)}

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f32 = ctypes.c_float
_sz = ctypes.c_size_t


class InitParams(ctypes.Structure):      # struct ggml_init_params (passed by value)
    _fields_ = [("mem_size", _sz), ("mem_buffer", _p), ("no_alloc", ctypes.c_bool)]


class CPlan(ctypes.Structure):           # struct ggml_cplan (ggml-cpu.h)
    _fields_ = [("work_size", _sz), ("work_data", _p), ("n_threads", ctypes.c_int),
                ("threadpool", _p), ("abort_callback", _p), ("abort_callback_data", _p),
                ("use_ref", ctypes.c_bool)]


class Tensor(ctypes.Structure):          # head of struct ggml_tensor (ggml.h), for layout checks
    _fields_ = [("type", ctypes.c_int), ("buffer", _p), ("ne", _i64 * 4), ("nb", _sz * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", _p * 10), ("view_src", _p), ("view_offs", _sz), ("data", _p),
                ("name", ctypes.c_char * 64)]


_LIB = None


def _sig(lib, name, res, *args):
    f = getattr(lib, name)
    f.restype = res
    f.argtypes = list(args)


def lib():
    """Load libggml-base (RTLD_GLOBAL) then libggml-cpu by absolute path; return the cpu lib
    (which also resolves every base symbol)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    base = ctypes.CDLL(os.path.join(LIB_DIR, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(LIB_DIR, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    b, c = base, cpu
    _sig(b, "ggml_init", _p, InitParams)
    _sig(b, "ggml_free", None, _p)
    _sig(b, "ggml_tensor_overhead", _sz)
    _sig(b, "ggml_graph_overhead", _sz)
    _sig(b, "ggml_row_size", _sz, ctypes.c_int, _i64)
    _sig(b, "ggml_nbytes", _sz, _p)
    _sig(b, "ggml_get_data", _p, _p)
    _sig(b, "ggml_new_tensor_1d", _p, _p, ctypes.c_int, _i64)
    _sig(b, "ggml_new_tensor_2d", _p, _p, ctypes.c_int, _i64, _i64)
    _sig(b, "ggml_new_tensor_3d", _p, _p, ctypes.c_int, _i64, _i64, _i64)
    _sig(b, "ggml_new_tensor_4d", _p, _p, ctypes.c_int, _i64, _i64, _i64, _i64)
    _sig(b, "ggml_view_4d", _p, _p, _p, _i64, _i64, _i64, _i64, _sz, _sz, _sz, _sz)
    _sig(b, "ggml_permute", _p, _p, _p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
    _sig(b, "ggml_set_rows", _p, _p, _p, _p, _p)
    _sig(b, "ggml_flash_attn_ext", _p, _p, _p, _p, _p, _p, _f32, _f32, _f32)
    _sig(b, "ggml_new_graph", _p, _p)
    _sig(b, "ggml_build_forward_expand", None, _p, _p)
    _sig(b, "ggml_quantize_chunk", _sz, ctypes.c_int, _p, _p, _i64, _i64, _i64, _p)
    if hasattr(b, "ggml_prec_set_acc"):
        _sig(b, "ggml_prec_set_acc", ctypes.c_bool, _p, ctypes.c_int)
    _sig(c, "ggml_cpu_init", None)
    _sig(c, "ggml_graph_plan", CPlan, _p, ctypes.c_int, _p)
    _sig(c, "ggml_graph_compute", ctypes.c_int, _p, ctypes.POINTER(CPlan))
    for f in ("ggml_cpu_has_avx2", "ggml_cpu_has_avx512", "ggml_cpu_has_f16c", "ggml_cpu_has_fma"):
        _sig(c, f, ctypes.c_int)
    c.ggml_cpu_init()
    _LIB = (b, c)
    return _LIB


def _t(p) -> Tensor:
    return ctypes.cast(p, ctypes.POINTER(Tensor)).contents


def _row_bytes(type_name: str, n: int) -> int:
    blk, size = _BLOCK[type_name]
    if n % blk:
        raise ValueError(f"{type_name} needs rows that are a multiple of {blk}, got {n}")
    return n // blk * size


class _Ctx:
    """A ggml context with allocated tensor data (no_alloc=False)."""

    def __init__(self, data_bytes: int, n_tensors: int = 32):
        self.b, self.c = lib()
        mem = data_bytes + n_tensors * (self.b.ggml_tensor_overhead() + 64) \
            + self.b.ggml_graph_overhead() + (1 << 20)
        self.ctx = self.b.ggml_init(InitParams(mem, None, False))
        if not self.ctx:
            raise MemoryError("ggml_init failed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.b.ggml_free(self.ctx)

    def new(self, type_id: int, *ne):
        f = getattr(self.b, f"ggml_new_tensor_{len(ne)}d")
        t = f(self.ctx, type_id, *ne)
        if not t:
            raise MemoryError("ggml_new_tensor failed")
        return t

    def fill(self, t, arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        n = self.b.ggml_nbytes(t)
        if n != arr.nbytes:
            raise ValueError(f"size mismatch: tensor {n} bytes, array {arr.nbytes}")
        ctypes.memmove(self.b.ggml_get_data(t), arr.ctypes.data, n)

    def read(self, t, dtype, shape) -> np.ndarray:
        n = self.b.ggml_nbytes(t)
        buf = (ctypes.c_char * n).from_address(self.b.ggml_get_data(t))
        return np.frombuffer(buf, dtype=np.uint8).copy().view(dtype).reshape(shape)

    def compute(self, out, n_threads: int, use_ref: bool = False):
        g = self.b.ggml_new_graph(self.ctx)
        self.b.ggml_build_forward_expand(g, out)
        plan = self.c.ggml_graph_plan(g, int(n_threads), None)
        work = np.empty(max(int(plan.work_size), 1), dtype=np.uint8)
        plan.work_data = work.ctypes.data if plan.work_size else None
        plan.use_ref = bool(use_ref)
        st = self.c.ggml_graph_compute(g, ctypes.byref(plan))
        if st != _STATUS_SUCCESS:
            raise RuntimeError(f"ggml_graph_compute returned status {st}")
        del work


def _as_rows(x: np.ndarray):
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(-1, x.shape[-1])


def stored(x: np.ndarray, type: str = "q8_0", method: str = "set_rows", n_threads: int = 1) -> np.ndarray:
    """Raw bytes ggml stores for float values x (..., n), as uint8 (..., row_bytes).

    method="set_rows": ggml_set_rows f32 -> type on the CPU backend, i.e. the CPU type traits'
        from_float -- the path llama.cpp uses to write its KV cache (for q8_0 on x86 this is the
        AVX quantize_row_q8_0: id = 127/amax, round-half-even; for q4_0 it is the reference
        quantize_row_q4_0_ref; for f16 ggml_cpu_fp32_to_fp16).
    method="quantize_chunk": ggml_quantize_chunk, the reference quantizers used to make model
        files (q8_0: id = 1/(amax/127), roundf). The two can differ for q8_0.
    """
    rows = _as_rows(x)
    nr, n = rows.shape
    tid = TYPES[type]
    rb = _row_bytes(type, n)
    if method == "quantize_chunk":
        b, _ = lib()
        out = np.zeros((nr, rb), dtype=np.uint8)
        got = b.ggml_quantize_chunk(tid, rows.ctypes.data, out.ctypes.data, 0, nr, n, None)
        if got != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {out.nbytes}")
        return out.reshape(*x.shape[:-1], rb)
    if method != "set_rows":
        raise ValueError(method)
    with _Ctx(2 * rows.nbytes + nr * rb + 8 * nr) as C:
        src = C.new(TYPES["f32"], n, nr)
        dst = C.new(tid, n, nr)
        idx = C.new(_I64, nr)
        C.fill(src, rows)
        C.fill(idx, np.arange(nr, dtype=np.int64))
        C.compute(C.b.ggml_set_rows(C.ctx, dst, src, idx), n_threads)
        return C.read(dst, np.uint8, (*x.shape[:-1], rb))


def dequantize(raw: np.ndarray, type: str) -> np.ndarray:
    """numpy decoding of stored rows (..., row_bytes) -> float32 (..., n)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    if type == "f32":
        return raw.view(np.float32).copy()
    if type == "f16":
        return raw.view(np.float16).astype(np.float32)
    blk, size = _BLOCK[type]
    b = raw.reshape(-1, size)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)            # (nb, 1)
    if type == "q8_0":
        q = b[:, 2:].view(np.int8).astype(np.float32)
    elif type == "q4_0":
        qs = b[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0
    else:
        raise ValueError(type)
    return (q * d).reshape(*lead, -1)


def flash_attn(q, k, v, mask, scale, n_threads: int = 2, k_type: str = "f16", v_type: str = "f16",
               max_bias: float = 0.0, logit_softcap: float = 0.0, use_ref: bool = False,
               return_stored: bool = False):
    """ggml_flash_attn_ext on the CPU backend, built as llama.cpp builds it (see module doc).

    q (n_tokens, n_head, d) f32; k, v (n_kv, n_head_kv, d) f32 values, converted to k_type /
    v_type ("f16": numpy float16 bits; "q8_0"/"q4_0": ggml_set_rows from f32, as llama.cpp
    writes its cache; "f32": as is) -- or uint8 (n_kv, n_head_kv, row_bytes) raw stored rows.
    mask (n_tokens, n_kv) f32 (0 / -inf), converted to f16, or None.
    Returns out (n_tokens, n_head, d) f32, or (out, k_bytes, v_bytes) with return_stored=True
    (the bytes the op read, uint8 (n_kv, n_head_kv, row_bytes)).
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    n_tokens, n_head, d = q.shape
    n_kv, n_head_kv = k.shape[0], k.shape[1]
    if v.shape[:2] != (n_kv, n_head_kv):
        raise ValueError(f"k {k.shape} / v {v.shape} mismatch")
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    dv = v.shape[2] if v.dtype != np.uint8 else None

    with _Ctx(8 * (q.nbytes + 4 * k.size + 4 * v.size) + 2 * n_tokens * n_kv
              + 4 * n_tokens * n_head * max(d, 1024) + (4 << 20)) as C:
        b = C.b

        def cache(x, tname, dim):
            """-> (tensor holding the cache rows, node to depend on)."""
            tid = TYPES[tname]
            if x.dtype == np.uint8:                                   # raw stored rows
                rb = x.shape[2]
                dim = rb // _BLOCK[tname][1] * _BLOCK[tname][0]
                if _row_bytes(tname, dim) != rb:
                    raise ValueError("raw row size does not match type")
                t = C.new(tid, dim * n_head_kv, n_kv)
                C.fill(t, x)
                return t, dim
            x = np.ascontiguousarray(x, dtype=np.float32)
            dim = x.shape[2]
            t = C.new(tid, dim * n_head_kv, n_kv)
            if tname == "f16":
                C.fill(t, x.astype(np.float16))
            elif tname == "f32":
                C.fill(t, x)
            else:                                                     # llama_kv_cache::cpy_k
                src = C.new(TYPES["f32"], dim * n_head_kv, n_kv)
                idx = C.new(_I64, n_kv)
                C.fill(src, x)
                C.fill(idx, np.arange(n_kv, dtype=np.int64))
                t = b.ggml_set_rows(C.ctx, t, src, idx)               # view of the cache
            return t, dim

        kc, dk = cache(k, k_type, d)
        vc, dv = cache(v, v_type, dv)
        if dk != d:
            raise ValueError(f"k head size {dk} != q head size {d}")

        def kv_view(t, tname, dim):                                    # llama_kv_cache::get_k
            rd = b.ggml_row_size(TYPES[tname], dim)
            rg = b.ggml_row_size(TYPES[tname], dim * n_head_kv)
            x = b.ggml_view_4d(C.ctx, t, dim, n_head_kv, n_kv, 1, rd, rg, rg * n_kv, 0)
            return b.ggml_permute(C.ctx, x, 0, 2, 1, 3)                # [dim, n_kv, n_head_kv]

        kt = kv_view(kc, k_type, dk)
        vt = kv_view(vc, v_type, dv)

        qt = C.new(TYPES["f32"], d, n_head, n_tokens)
        C.fill(qt, q)
        qt = b.ggml_permute(C.ctx, qt, 0, 2, 1, 3)                     # [d, n_tokens, n_head]

        mt = None
        if mask is not None:
            mask = np.asarray(mask, dtype=np.float32)
            if mask.shape != (n_tokens, n_kv):
                raise ValueError(f"mask {mask.shape} != (n_tokens, n_kv) = {(n_tokens, n_kv)}")
            mt = C.new(TYPES["f16"], n_kv, n_tokens, 1, 1)
            C.fill(mt, mask.astype(np.float16))

        fa = b.ggml_flash_attn_ext(C.ctx, qt, kt, vt, mt, float(scale), float(max_bias),
                                   float(logit_softcap))
        if hasattr(b, "ggml_prec_set_acc"):
            b.ggml_prec_set_acc(fa, _PREC_F32)

        # layout checks (ne order): q [d, T, H], k [d, n_kv, Hkv], v [dv, n_kv, Hkv], res [dv, H, T]
        assert list(_t(qt).ne) == [d, n_tokens, n_head, 1]
        assert list(_t(kt).ne) == [d, n_kv, n_head_kv, 1]
        assert list(_t(vt).ne) == [dv, n_kv, n_head_kv, 1]
        assert list(_t(fa).ne) == [dv, n_head, n_tokens, 1]

        C.compute(fa, n_threads, use_ref)
        out = C.read(fa, np.float32, (n_tokens, n_head, dv))
        if not return_stored:
            return out
        kb = C.read(kc, np.uint8, (n_kv, n_head_kv, -1))
        vb = C.read(vc, np.uint8, (n_kv, n_head_kv, -1))
        return out, kb, vb


# --------------------------------------------------------------------------- self-check

def _ref_attn(q, k, v, mask, scale):
    """float64 softmax attention with GQA broadcast (q head h uses kv head h // (H/Hkv))."""
    T, H, d = q.shape
    rep = H // k.shape[1]
    kk = np.repeat(k.astype(np.float64), rep, axis=1)                  # (n_kv, H, d)
    vv = np.repeat(v.astype(np.float64), rep, axis=1)
    s = np.einsum("thd,khd->htk", q.astype(np.float64), kk) * scale
    s = s + mask.astype(np.float64)[None]
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("htk,khd->thd", p, vv)


def _causal(n_tokens, n_kv, n_past):
    pos = n_past + np.arange(n_tokens)[:, None]
    return np.where(np.arange(n_kv)[None, :] <= pos, 0.0, -np.inf).astype(np.float32)


def main() -> int:
    b, c = lib()
    print(f"ggml lib dir: {LIB_DIR}")
    print("cpu: avx2=%d avx512=%d f16c=%d fma=%d" % (c.ggml_cpu_has_avx2(), c.ggml_cpu_has_avx512(),
                                                    c.ggml_cpu_has_f16c(), c.ggml_cpu_has_fma()))
    rng = np.random.default_rng(1234)
    d, H, Hkv, n_kv = 64, 14, 2, 300
    scale = 1.0 / np.sqrt(d)
    ok = True

    def report(name, got, ref, tol):
        nonlocal ok
        err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
        fin = bool(np.all(np.isfinite(got)))
        good = fin and err <= tol
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {name:48s} finite={fin} max|err|/max|ref|={err:.2e} (tol {tol:g})")

    k = rng.standard_normal((n_kv, Hkv, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, Hkv, d)).astype(np.float32)
    for T, n_past in ((1, n_kv - 11), (100, n_kv - 100)):   # 1 token: last 10 cells masked
        qq = rng.standard_normal((T, H, d)).astype(np.float32)
        mask = _causal(T, n_kv, n_past)
        ref = _ref_attn(qq, k, v, mask, scale)
        print(f"n_tokens={T} n_kv={n_kv} n_head={H} n_head_kv={Hkv} d={d}")
        for kt in ("f16", "q8_0", "q4_0"):
            out, kb, vb = flash_attn(qq, k, v, mask, scale, n_threads=2, k_type=kt, v_type=kt,
                                     return_stored=True)
            assert out.shape == (T, H, d) and out.dtype == np.float32
            # vs exact attention on the original values: f16 tight, quantized looser
            report(f"{kt}: vs float64 attention", out, ref, {"f16": 1e-2, "q8_0": 3e-2, "q4_0": 0.25}[kt])
            # vs exact attention on the values the op actually read (checks stored-byte layout)
            kd, vd = dequantize(kb, kt), dequantize(vb, kt)
            report(f"{kt}: vs float64 attention on stored K/V", out, _ref_attn(qq, kd, vd, mask, scale),
                   {"f16": 1e-2, "q8_0": 1e-2, "q4_0": 3e-2}[kt])
            if kt == "f16":
                same = np.array_equal(kb, stored(k, "f16"))
                ok &= same
                print(f"  {'ok  ' if same else 'FAIL'} f16: numpy astype bits == ggml set_rows bits: {same}")
            else:
                same = np.array_equal(kb, stored(k, kt, "set_rows"))
                ok &= same
                print(f"  {'ok  ' if same else 'FAIL'} {kt}: stored bytes == stored(k, '{kt}') (set_rows): {same}")
                nd = int(np.sum(np.any(stored(k, kt, "set_rows").reshape(-1, _BLOCK[kt][1])
                                       != stored(k, kt, "quantize_chunk").reshape(-1, _BLOCK[kt][1]), axis=1)))
                print(f"       {kt}: blocks where set_rows != quantize_chunk bytes: {nd} of {k.size // 32}")
            # raw bytes in -> same result
            out2 = flash_attn(qq, kb, vb, mask, scale, n_threads=2, k_type=kt, v_type=kt)
            same = np.array_equal(out, out2)
            ok &= same
            print(f"  {'ok  ' if same else 'FAIL'} {kt}: raw stored bytes as input give identical output: {same}")
        if T > 1:
            o1 = flash_attn(qq, k, v, mask, scale, n_threads=1)
            o2 = flash_attn(qq, k, v, mask, scale, n_threads=2)
            print(f"  info f16 prefill n_threads 1 vs 2 bit-identical: {np.array_equal(o1, o2)}")
            orf = flash_attn(qq, k, v, mask, scale, n_threads=2, use_ref=True)
            print(f"  info f16 prefill tiled vs use_ref max|diff| = {float(np.max(np.abs(o2 - orf))):.3e}")

    # one-token decode over >= 512 cells: ggml splits the cells into n_threads chunks
    n_kv2 = 600
    k2 = rng.standard_normal((n_kv2, Hkv, d)).astype(np.float32)
    v2 = rng.standard_normal((n_kv2, Hkv, d)).astype(np.float32)
    q2 = rng.standard_normal((1, H, d)).astype(np.float32)
    m2 = _causal(1, n_kv2, n_kv2 - 7)
    ref2 = _ref_attn(q2, k2, v2, m2, scale)
    print(f"n_tokens=1 n_kv={n_kv2} (split-KV decode path)")
    outs = {}
    for nt in (1, 2):
        outs[nt] = flash_attn(q2, k2, v2, m2, scale, n_threads=nt)
        report(f"f16 n_threads={nt}: vs float64 attention", outs[nt], ref2, 1e-2)
    oref = flash_attn(q2, k2, v2, m2, scale, n_threads=2, use_ref=True)
    report("f16 use_ref=True: vs float64 attention", oref, ref2, 1e-2)
    print(f"  info n_threads 1 vs 2 bit-identical: {np.array_equal(outs[1], outs[2])}, "
          f"max|diff| = {float(np.max(np.abs(outs[1] - outs[2]))):.3e}")
    print(f"  info n_threads=1 vs use_ref bit-identical: {np.array_equal(outs[1], oref)}")
    # the cache-writing q8_0 quantizer (set_rows -> CPU from_float) is not the reference one
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = (127.0, 0.5, 2.5, -1.5)
    print("q8_0 ties [127, .5, 2.5, -1.5]: set_rows -> %s, quantize_chunk -> %s"
          % (stored(x, "q8_0")[0, 2:6].view(np.int8).tolist(),
             stored(x, "q8_0", "quantize_chunk")[0, 2:6].view(np.int8).tolist()))
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
