"""Q4_0, Q5_0, Q8_0, Q4_K and Q6_K weights repacked at load for AVX512-VNNI kernels.

In the file each row is a run of blocks, so a kernel that walks rows must unpack and scale
each block on its own (Q4_0/Q5_0 25-28 GB/s here, compute-bound). Repacked, 16 rows share
each block's bytes the way quant.gemm8's panels do: byte 4i + j of a 64-byte chunk belongs
to row i, so one vpdpbusd with 4 broadcast activation bytes advances 16 rows, and the 16
scales of a block are one vector. Measured (Kernels in BENCHMARKS.md, 2 threads): Q4_0 92.5
GB/s on a matrix in L3, 55.7 on one from memory, against 28 for the row kernel. The kernels
take 1, 2 (Q4_0), 4 or 8 tokens, reading and unpacking each group once for them.

They sum the same integers as the row kernels, and add them into float32 in the order of
the kernel llama.cpp runs for the type and batch size (tests/llama_orders.py; the README
lists them), so that the results are llama.cpp's bit for bit: a batch takes its batch
kernels' order (batch_tokens), decode and speculative checks (batch=False) its one-token
kernels' order for every token. Hence the group kernels (_kernel) are not fastmath: LLVM would reorder.

Per group of 16 rows and block b:
  Q4_0 (288): 4 chunks of nibble bytes: chunk c byte 4i+j = row i's byte 4c+j, whose low
              nibble is value 4c+j and high nibble value 16+4c+j; then 16 f16 d.
  Q5_0 (352): the same 4 chunks; then per chunk c two 64-bit planes of fifth bits, bit 4i+j
              = bit 4c+j (low) and bit 16+4c+j (high) of row i's qh; then 16 f16 d.
  Q8_0 (544): 8 chunks, chunk c byte 4i+j = row i's value 4c+j + 128 (unsigned); 16 f16 d.
  Q4_K (2368, 256 values): 32 chunks, chunk 8p+c byte 4i+j = row i's qs byte 32p+4c+j (low
              nibble value 64p+4c+j, high 64p+32+4c+j); then the 8 six-bit scales and the
              8 mins as bytes, [j][row]; then 16 f16 d and 16 f16 dmin (64 bytes more than
              the file's 16 blocks: the scales unpacked).
  Q6_K (3360): 16 quads of 3 chunks, quad 8h+c for values 128h + 32s + 4c + j of row i
              (s = 0..3) at byte 4i+j: chunk s (s < 3) holds value s in its low six bits
              and two bits of value 3 on top (chunk 0 bits 0-1, chunk 1 bits 2-3, chunk 2
              bits 4-5); then the 16 int8 scales as bytes [j][row], 16 f16 d (the file's size).
The unsigned values carry an offset (8, 16, 128; Q6_K 32 per 16 values) that comes off
through the sums of the activations: sum (u - off) x = sum u x - off * sum x (per 4
values where llama.cpp's lanes are 4 values wide).

A copy: the file's pages of a repacked tensor are released (GGUFFile.release), so resident
memory stays the size of the weights (1.5b: peak RSS within the test's file + KV + 300 MB).
NUMBAT_REPACK=0 keeps the file's layout.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import zlib
from pathlib import Path

import numpy as np
from gguf_io.types import GGMLQuantizationType as T
from llvmlite import ir
import llvmlite.binding as llvm
import numba
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from quant.act import quantize_q8_0
from quant.kquants import ROWS, _byte, _k4_scales, quantize_x
from quant.gemm8 import I8, I32, F32, V64B, V16I, V16F, _ptr, _splat
from quant.intrin import c_array, call_c, fetch_add
from quant import amx, cpu
from quant.common import threads

# numba writes object code straight from LLVM: inline asm with instructions in it (Q6_K's
# vpdpwssd, _rows16) needs the host's assembly parser registered first
llvm.initialize_native_asmparser()
I1 = ir.IntType(1)
V32H = ir.VectorType(ir.IntType(16), 32)
# kind: (file block bytes, group-block bytes, offset of the unsigned values, values per block)
Q4_0, Q5_0, Q8_0, Q4_K, Q6_K = 0, 1, 2, 3, 4
LAYOUT = {Q4_0: (18, 288, 8, 32), Q5_0: (22, 352, 16, 32), Q8_0: (34, 544, 128, 32), Q4_K: (144, 2368, 0, 256),
          Q6_K: (210, 3360, 32, 256)}
# a group-block's 64-byte weight loads by kind (where a CPU row spreads its prefetches over them)
LOADS = (4, 4, 8, 32, 48)
KINDS = {T.Q4_0: Q4_0, T.Q5_0: Q5_0, T.Q8_0: Q8_0, T.Q4_K: Q4_K, T.Q6_K: Q6_K}
NAMES = {k: T(t).name for t, k in KINDS.items()}


class Packed:
    """A repacked (rows, cols) weight: data (rows // 16, blocks * group-block bytes)."""

    def __init__(self, type_id: int, data: np.ndarray, rows: int, cols: int):
        self.type_id, self.data, self.rows, self.cols = int(type_id), data, rows, cols
        self.kind = KINDS[type_id]
        self.shape = (rows, cols)       # what callers check of a weight
        self.bound = {}                 # small batches' calls, bound once (matmul_rows)


def enabled() -> bool:
    return cpu.repacking()


def supports(type_id: int, rows: int) -> bool:
    return cpu.repacked(type_id, rows)


@njit(inline="always")
def _group_legacy(raw, kind, out, g):
    """In 16-bit words (every block size is even): row i's word h of chunk c of block b goes
    to word 32c + 2i + h of the group-block (Q4_0/Q5_0: h < 2; Q8_0: h < 2 per 4 bytes)."""
    bs = 17 if kind == Q8_0 else 11 if kind == Q5_0 else 9         # words
    gb = 272 if kind == Q8_0 else 176 if kind == Q5_0 else 144
    q0 = 3 if kind == Q5_0 else 1
    nb = raw.shape[1] // (2 * bs)
    o = out.view(np.uint16)[g]
    if kind == Q5_0:                     # the fifth-bit planes are or-ed in below
        for b in range(nb):
            for k in range(32):
                o[b * gb + 128 + k] = 0
    for i in range(16):
        w = raw.view(np.uint16)[16 * g + i]
        for b in range(nb):
            wb, ob = b * bs, b * gb
            o[ob + gb - 16 + i] = w[wb]                                   # d
            if kind == Q8_0:
                for c in range(8):
                    o[ob + 32 * c + 2 * i] = w[wb + 1 + 2 * c] ^ 0x8080
                    o[ob + 32 * c + 2 * i + 1] = w[wb + 2 + 2 * c] ^ 0x8080
            else:
                for c in range(4):
                    o[ob + 32 * c + 2 * i] = w[wb + q0 + 2 * c]
                    o[ob + 32 * c + 2 * i + 1] = w[wb + q0 + 2 * c + 1]
            if kind == Q5_0:     # nibble 4c+h*16.. of qh -> bits 4i.. of plane (c, h)
                qh = np.uint32(w[wb + 1]) | (np.uint32(w[wb + 2]) << 16)
                for c in range(4):
                    for h in range(2):
                        nib = (qh >> np.uint32(16 * h + 4 * c)) & np.uint32(15)
                        o[ob + 128 + 8 * c + 4 * h + i // 4] |= np.uint16(nib << np.uint32(4 * (i % 4)))


@njit(inline="always")
def _group_q4_K(raw, out, g):
    """In 32-bit words for the quants (the file's blocks are 36 words), bytes for the rest."""
    nb = raw.shape[1] // 144
    o, o4, o2 = out[g], out.view(np.uint32)[g], out.view(np.uint16)[g]
    for i in range(16):
        w, w4, w2 = raw[16 * g + i], raw.view(np.uint32)[16 * g + i], raw.view(np.uint16)[16 * g + i]
        for b in range(nb):
            for k in range(32):             # chunk k = 8p + c holds qs word 8p + c
                o4[b * 592 + 16 * k + i] = w4[b * 36 + 4 + k]
            sm = _k4_scales(w, b * 144 + 4)
            for j in range(8):
                o[b * 2368 + 2048 + 16 * j + i] = _byte(sm[j >> 2], j & 3)
                o[b * 2368 + 2176 + 16 * j + i] = _byte(sm[2 + (j >> 2)], j & 3)
            o2[b * 1184 + 1152 + i] = w2[b * 72]          # d
            o2[b * 1184 + 1168 + i] = w2[b * 72 + 1]      # dmin


@njit(inline="always")
def _group_q6_K(raw, out, g):
    """The 6-bit values regrouped (see the module's docstring), scales and d as bytes and words."""
    nb = raw.shape[1] // 210
    o, o2 = out[g], out.view(np.uint16)[g]
    for i in range(16):
        w, w2 = raw[16 * g + i], raw.view(np.uint16)[16 * g + i]
        for b in range(nb):
            for h in range(2):
                for l in range(32):         # values 128h + l + 32s of the block, s = 0..3
                    ql0, ql1, qh = w[b * 210 + 64 * h + l], w[b * 210 + 64 * h + 32 + l], w[b * 210 + 128 + 32 * h + l]
                    v0 = (ql0 & 15) | (qh & 3) << 4
                    v1 = (ql1 & 15) | (qh >> 2 & 3) << 4
                    v2 = ql0 >> 4 | (qh >> 4 & 3) << 4
                    v3 = ql1 >> 4 | (qh >> 6) << 4
                    at = b * 3360 + 192 * (8 * h + l // 4) + 4 * i + l % 4
                    o[at] = v0 | (v3 & 3) << 6
                    o[at + 64] = v1 | (v3 >> 2 & 3) << 6
                    o[at + 128] = v2 | (v3 >> 4) << 6
            for j in range(16):
                o[b * 3360 + 3072 + 16 * j + i] = w[b * 210 + 192 + j]
            o2[b * 1680 + 1664 + i] = w2[b * 105 + 104]       # d


@njit(nogil=True, cache=True)
def _repack(raw, kind, out, g0, g1):
    """raw's groups g0..g1 of 16 rows into out (one compiled function for every kind: each
    costs a cache load at startup). Serial, without the GIL: pack() runs it on threads; as a
    prange loop it compiled twice as long (3.5 against 1.8 s of every first run)."""
    for g in range(g0, g1):
        if kind == Q4_K:
            _group_q4_K(raw, out, g)
        elif kind == Q6_K:
            _group_q6_K(raw, out, g)
        else:
            _group_legacy(raw, kind, out, g)


# what the layout of a kept buffer (pack_file's keep) depends on: this file's code
_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def packed_bytes(type_id: int, shape) -> int:
    bs, gb, _, _ = LAYOUT[KINDS[type_id]]
    return shape[0] // 16 * (shape[1] // bs) * gb


def pack(type_id: int, raw: np.ndarray, out: np.ndarray | None = None, fill: bool = True, pool=None) -> Packed:
    """raw (rows, row_bytes) repacked into out (uint8, at least packed_bytes) or a new array;
    fill=False: out holds raw repacked already (a kept buffer). pool: a thread pool whose
    threads share the groups (numba's thread count of them: -t)."""
    kind = KINDS[type_id]
    rows, (bs, gb, _, nv) = raw.shape[0], LAYOUT[kind]
    nb = raw.shape[1] // bs
    n = packed_bytes(type_id, raw.shape)
    out = (np.empty(n, np.uint8) if out is None else out[:n]).reshape(rows // 16, nb * gb)
    if fill:
        groups = rows // 16
        if pool is None:
            _repack(raw, kind, out, 0, groups)
        else:
            parts = max(1, min(numba.get_num_threads(), groups))
            cut = [groups * i // parts for i in range(parts + 1)]
            for job in [pool.submit(_repack, raw, kind, out, cut[i], cut[i + 1]) for i in range(parts)]:
                job.result()
    return Packed(type_id, out, rows, nb * nv)


def pack_file(f, names, groups=(), keep=None, q4_0=frozenset()) -> dict:
    """The tensors of names that repack (supports()), into one buffer (large enough for the
    kernel's transparent huge pages: writing it costs a fault per 2 MB, not per 4 KB), their
    mapped pages released after. 0.5b: about 0.2 s for 395 MB. (Reading the file with read()
    instead of the mapping took 0.44 s here for the same bytes.)
    groups: tuples of names that take the same input (q, k, v; gate, up), laid out one after
    the other. Where all members repack to one type and width, the tuple maps to one Packed of
    all their rows: one kernel call, the input quantized once; otherwise so does its longest
    leading run of two or more that do (q and k where v has another type, as in half the layers
    of a Q4_K_M file).
    keep: a store of derived bytes (models.derived: load/create/save) that maps the buffer a former
    load wrote instead of packing again, keyed by this file, what is packed and this code.
    q4_0: types whose matrices are requantized to Q4_0 first (quant.requantize: a draft's, see
    runner.backends.numba_cpu.DRAFT_Q4_0), kept apart from the file's own repacking."""
    grouped = [n for g in groups for n in g]
    todo = [(n, t, shape, make, packed_bytes(t, shape))
            for n, t, shape, make in _plan(f, grouped + [n for n in names if n not in grouped], q4_0)]
    total = sum(size for *_, size in todo)
    key = repr([_SOURCE_DIGEST, LAYOUT, [(n, t, shape) for n, t, shape, *_ in todo]])
    kind = "repacked-q4_0" if q4_0 else "repacked"
    arena = keep.load(f.path, kind, key, total) if keep else None
    out, span, at = {}, {}, 0
    fill, made = arena is None, None
    if fill:
        from concurrent.futures import ThreadPoolExecutor     # not imported by a start that maps
        made = keep.create(f.path, kind, key, total) if keep else None     # filled in place
        arena = made.array if made else np.empty(total, np.uint8)
    with ThreadPoolExecutor(numba.get_num_threads()) if fill else contextlib.nullcontext() as pool:
        for n, t, shape, make, size in todo:     # a kept buffer needs only the shape
            out[n] = pack(t, make() if fill else np.broadcast_to(np.uint8(0), shape), arena[at:at + size], fill, pool)
            if fill:
                f.release(n)
            span[n] = (at, at + size)
            at += size
    if made:
        made.commit()
    elif fill and keep:
        keep.save(f.path, kind, key, arena)
    for g in groups:
        ps = [out.get(n) for n in g]
        m = 0       # the leading members of one type and width (adjacent, in order)
        while m < len(ps) and ps[m] and (ps[m].type_id, ps[m].cols) == (ps[0].type_id, ps[0].cols):
            m += 1
        if m >= 2:
            rows = sum(p.rows for p in ps[:m])
            data = arena[span[g[0]][0]:span[g[m - 1]][1]].reshape(rows // 16, -1)
            out[g[:m]] = Packed(ps[0].type_id, data, rows, ps[0].cols)
    return out


def _plan(f, names, q4_0) -> list:
    """(name, type it repacks as, its raw shape in that type, a maker of those raw bytes) for
    each tensor of names that repacks."""
    from quant import qtype, requantize     # quant imports this module
    todo = []
    for n in names:
        t, raw, cols = f.tensors[n].type_id, f.raw(n), f.tensors[n].dims[0]
        as_type = repack_type(t, raw.shape[0], cols, q4_0)
        if as_type is None:
            continue
        if as_type != t:        # requantized
            todo.append((n, as_type, (raw.shape[0], qtype(as_type).row_bytes(cols)), functools.partial(requantize, t, raw, cols)))
        else:
            todo.append((n, t, raw.shape, lambda raw=raw: raw))
    return todo


def repack_type(t: int, rows: int, cols: int, q4_0=frozenset()) -> int | None:
    """The type pack_file repacks a (rows, cols) matrix of type t as (q4_0: types requantized
    to Q4_0 first), or None where it is not repacked."""
    if t in q4_0 and cols % 32 == 0 and supports(T.Q4_0, rows):
        return T.Q4_0
    return t if supports(t, rows) else None


def _rows16(kind, n_tok, batch=False):
    """Y[t0 + t, 16g:16g+16] = group g of pk (2-D) . X[t0 + t] for t < n_tok, over nb blocks:
    X as xq (T, n) int8, xd (T, blocks) float32 scales, isum (T, .) sums of xq (int32; Q4_0
    per 32 values; Q5_0/Q8_0 -offset times the sums per 4; Q4_K per 32, two int16 sums in
    each int32; Q6_K 32 times the sums per 16 (its batch kernel), then the sums per 16 as int16
    pairs, sub-blocks 2l and 2l + 1 for lane l (its lanes' offsets): one type for every kind, so each kind's
    group kernel compiles once). Each token's lanes go through the same operations for any n_tok
    (verification gets decode's bits); the weights are loaded and unpacked once for all n_tok."""
    _, gb, off, _ = LAYOUT[kind]
    pf = None if batch else cpu.KIND.prefetch.get((NAMES[kind], n_tok), cpu.KIND.prefetch.get(n_tok))     # a batch re-reads a group from cache: no prefetch
    pf, level = pf if isinstance(pf, tuple) else (pf, 3)
    spread = n_tok in cpu.KIND.spread_prefetch

    @intrinsic
    def rows16(typingctx, pk, g, nb, xq, xd, isum, y, t0):
        def codegen(context, builder, sig, args):
            apk, ag, anb, axq, axd, aisum, ay, at0 = args
            tpk, txq, txd, tis, ty = sig.args[0], sig.args[3], sig.args[4], sig.args[5], sig.args[6]
            i64 = ag.type
            c = lambda v: ir.Constant(i64, v)
            pkarr = context.make_array(tpk)(context, builder, apk)
            gbase = builder.mul(ag, cgutils.unpack_tuple(builder, pkarr.strides, 2)[0])
            dim1 = lambda ty, a: cgutils.unpack_tuple(builder, context.make_array(ty)(context, builder, a).shape, 2)[1]
            ldx, ldd, lds, ldy = dim1(txq, axq), dim1(txd, axd), dim1(tis, aisum), dim1(ty, ay)
            row = lambda t, ld: builder.mul(builder.add(at0, c(t)), ld)
            dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16I, [V16I, V64B, V64B]),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            dpwssd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16I, [V16I, V32H, V32H]),
                                                    "llvm.x86.avx512.vpdpwssd.512")
            # vpdpwssd as inline asm, where it accumulates in a chain: LLVM's machine combiner
            # splits the intrinsic into vpmaddwd + vpaddd to shorten the chain (see quad)
            dpwssd_asm = lambda acc_, a_, b_: builder.asm(ir.FunctionType(V16I, [V16I, V32H, V32H]), "vpdpwssd $3, $2, $0",
                                                          "=v,0,v,v", [acc_, a_, b_], False)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
            maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32H, [V64B, V64B]),
                                                     "llvm.x86.avx512.pmaddubs.w.512")
            base = builder.bitcast(pkarr.data, I8.as_pointer())
            pending = []        # (block offset, line) of the block's prefetches not yet issued

            def ahead(k):       # the next k of them: read, into the row's cache level, data pf ahead
                for o_, line in pending[:k]:
                    builder.call(prefetch, [builder.gep(base, [builder.add(o_, c(pf + line))]), *(ir.Constant(I32, v) for v in (0, level, 1))])
                del pending[:k]

            def load(o, ty):
                if pending and ty == V64B:
                    ahead(1)
                return builder.load(builder.bitcast(builder.gep(base, [o]), ty.as_pointer()), align=1)

            def xword(t, o):          # 4 activation bytes of token t, broadcast
                w = builder.load(_ptr(context, builder, txq, axq, builder.add(row(t, ldx), o), I32), align=1)
                return builder.bitcast(_splat(builder, w, V16I), V64B)

            def scalar(ty, a, t, ld, o, lty):
                return builder.load(_ptr(context, builder, ty, a, builder.add(row(t, ld), o), lty))

            def bytes16(o):           # 16 unsigned bytes as int32 lanes
                return builder.zext(load(o, ir.VectorType(I8, 16)), V16I)

            def halves16(o):
                return builder.fpext(load(o, ir.VectorType(ir.HalfType(), 16)), V16F)

            def legacy_runs(o, ch):
                """Chunk ch of a Q4_0/Q5_0/Q8_0 block at o as (lane, unsigned values, first value):
                Q8_0's chunk is lane ch; the others' low nibbles lane ch, high nibbles ch + 4."""
                if kind == Q8_0:
                    return [(ch, load(builder.add(o, c(64 * ch)), V64B), 4 * ch)]
                q = load(builder.add(o, c(64 * ch)), V64B)
                lo, hi = builder.and_(q, low4), builder.lshr(q, ir.Constant(V64B, [4] * 64))
                if kind == Q5_0:
                    # the fifth bit: where set, the nibble again with 16 in (a gf2p8affine that
                    # moves the nibble down and xors 16 in; masked, it merges into the plain one)
                    aff = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V64B, [V64B, V64B, I8]),
                                                         "llvm.x86.vgf2p8affineqb.512")
                    for half, shift in ((0, 0), (1, 4)):
                        mat = ir.Constant(V64B, [0, 0, 0, 0, 8 << shift, 4 << shift, 2 << shift, 1 << shift] * 8)
                        mk = load(builder.add(o, c(256 + 16 * ch + 8 * half)), ir.IntType(64))
                        with16 = builder.call(aff, [q, mat, ir.Constant(I8, 16)])
                        bits = builder.bitcast(mk, ir.VectorType(I1, 64))
                        if half == 0:
                            lo = builder.select(bits, with16, lo)
                        else:
                            hi = builder.select(bits, with16, hi)
                return [(ch, lo, 4 * ch), (4 + ch, hi, 16 + 4 * ch)]

            def legacy_lanes(b, o, ch):
                """fma each token's lanes of chunk ch of block b into its accumulators."""
                x0 = builder.mul(b, c(32))
                d = halves16(builder.add(o, c(gb - 32)))
                runs = legacy_runs(o, ch)
                for t in range(n_tok):
                    dd = builder.fmul(d, _splat(builder, scalar(txd, axd, t, ldd, b, F32), V16F))
                    for lane, u, v0 in runs:     # isum: -off times the sums per 4 values: the dot starts there
                        s4 = scalar(tis, aisum, t, lds, builder.add(builder.mul(b, c(8)), c(v0 // 4)), I32)
                        v = builder.call(dpbusd, [_splat(builder, s4, V16I), u, xword(t, builder.add(x0, c(v0)))])
                        a = acc[t][lane]
                        builder.store(builder.call(fma, [dd, builder.sitofp(v, V16F), builder.load(a)]), a)

            def q6_values(o, h, ch):
                """Values 4ch..4ch+3 of the four 32-value runs s_ of half h of the Q6_K block
                at o, (s_, q) with q (0..63) as unsigned bytes: runs 0-2 are the low six bits
                of the quad's three chunks, run 3 their top two bits (seven instructions for
                the four, eleven from the file's nibbles and bit pairs)."""
                a, b_, c_ = (load(builder.add(o, c(192 * (8 * h + ch) + 64 * r)), V64B) for r in range(3))
                six = ir.Constant(V64B, [63] * 64)
                top = lambda v, sh, m: builder.and_(builder.lshr(v, ir.Constant(V64B, [sh] * 64)), ir.Constant(V64B, [m] * 64))
                v3 = builder.or_(builder.or_(builder.lshr(a, ir.Constant(V64B, [6] * 64)), top(b_, 4, 12)), top(c_, 2, 48))
                return [(0, builder.and_(a, six)), (1, builder.and_(b_, six)), (2, builder.and_(c_, six)), (3, v3)]

            def q6_block(b, o):
                """llama.cpp's lanes for Q6_K (vec_dot_q6_K_q8_K): lane ch sums, over the eight
                runs of 32 values of block b (at o), scale * (q . x) of values 4ch..4ch+3 of
                the run, less 32 * (the scaled x-sums of sub-blocks 2ch and 2ch + 1); then
                d_x * d_w times the lane into each token's accumulator ch."""
                x0 = builder.mul(b, c(256))
                scale = lambda j: builder.sext(load(builder.add(o, c(3072 + 16 * j)), ir.VectorType(I8, 16)), V16I)
                neg32 = lambda v: builder.sub(zero, builder.shl(v, ir.Constant(V16I, [5] * 16)))
                words = q6_slots if in_memory else None    # four tokens (set below)

                def scale_words(j):     # sub-block j's scale in both words of each row's lane
                    sv = scale(j)
                    return builder.bitcast(builder.or_(builder.and_(sv, low16), builder.shl(sv, ir.Constant(V16I, [16] * 16))), V32H)

                def offset(ch):
                    # lane = -32 (sa Sa + sb Sb) for the x-sums Sa, Sb of sub-blocks 2ch, 2ch + 1
                    # (isum's pairs after the sums per 16; |Sa| <= 2048) and their scales sa, sb,
                    # as one vpdpwssd over the word pairs (-32 sa, -32 sb) and (Sa, Sb): the pair
                    # read as one broadcast (built here from two sums, it took seven scalar
                    # instructions a lane and token)
                    if words:   # sa's low word and sb's high word, times -32
                        sa, sb = (builder.bitcast(builder.load(words[j]), V16I) for j in (2 * ch, 2 * ch + 1))
                        ab = builder.or_(builder.and_(sa, low16), builder.and_(sb, ir.Constant(V16I, [-65536] * 16)))
                        sab = builder.mul(builder.bitcast(ab, V32H), ir.Constant(V32H, [-32] * 32))
                    else:
                        sab = builder.bitcast(builder.or_(builder.and_(neg32(scale(2 * ch)), low16),
                                                          builder.shl(neg32(scale(2 * ch + 1)), ir.Constant(V16I, [16] * 16))), V32H)
                    lane = []
                    for t in range(n_tok):      # (Sa, Sb) as the quantizer packed them (_quantize_k)
                        pair = scalar(tis, aisum, t, lds, builder.add(pairs0, builder.add(builder.mul(b, c(8)), c(ch))), I32)
                        lane.append(builder.call(dpwssd, [zero, sab, builder.bitcast(_splat(builder, pair, V16I), V32H)]))
                    return lane

                def quad(lane, h, ch):
                    for s_, w in q6_values(o, h, ch):
                        # vpmaddubsw's pair sums fit an int16 (|2 * 63 * 128| < 2^15, no
                        # saturation), so the scale's multiply, the pairs' sum and the lane's
                        # add are one vpdpwssd against the scale in both words: the same
                        # integers in two instructions a token. (A vpdpbusd from zero, then
                        # a vpdpwssd against the scale in the low word, took a zeroing vpxor
                        # too.) The vpdpwssd is inline asm: LLVM's machine combiner splits
                        # the intrinsic into vpmaddwd + vpaddd to shorten the lane's chain,
                        # a third more instructions where the ports, not the chain, bound
                        # the kernel (Q6_K's four tokens from cache, one thread, Emerald
                        # Rapids, variants alternating in one process: vpmaddubsw with the
                        # intrinsic 12.1 GB/s, with the asm 16.4; in another run the old pair
                        # 17.6, this one with the accumulators below in memory 19.5)
                        j = 8 * h + 2 * s_ + ch // 4
                        sc = builder.load(words[j]) if words else scale_words(j)
                        for t in range(n_tok):
                            xo = builder.add(x0, c(128 * h + 32 * s_ + 4 * ch))
                            pairs = builder.call(maddubs, [w, xword(t, xo)])
                            lane[t] = dpwssd_asm(lane[t], pairs, sc)

                def scales():   # d_x d_w of each token
                    d = halves16(builder.add(o, c(3328)))
                    return [builder.fmul(_splat(builder, scalar(txd, axd, t, ldd, b, F32), V16F), d) for t in range(n_tok)]

                def finish(ch, lane):
                    dds = [builder.load(p_) for p_ in q6_dd] if words else scales()
                    for t in range(n_tok):
                        dd = dds[t]
                        a = acc[t][ch]
                        builder.store(builder.call(fma, [dd, builder.sitofp(lane[t], V16F), builder.load(a)]), a)

                # integer sums: their order is free (the bits are the same)
                if n_tok == 1:
                    # the quads in the layout's order: one ascending stream, which the hardware
                    # prefetcher follows (lane by lane, the reads alternated between the block's
                    # halves: 10 GB/s on Zen 4 without software prefetch); the eight lanes are
                    # independent chains across the block
                    lanes = [offset(ch) for ch in range(8)]
                    for h in range(2):
                        for ch in range(8):
                            quad(lanes[ch], h, ch)
                    for ch in range(8):
                        finish(ch, lanes[ch])
                else:
                    # lane by lane: four tokens' eight lanes would not fit the registers across
                    # the block. The sub-blocks' scale words and each token's d_x d_w first,
                    # into memory, once a block: each serves several lanes, and behind the
                    # fences between lanes every lane built them again (two shuffles a run, a
                    # multiply a token). Four tokens from cache, one thread, Emerald Rapids
                    # (bench/packed_ab.py): 41.5 -> 33.6 us with the pairs read whole (offset);
                    # from memory on two threads 3317 -> 2891 us; one token unchanged. (A
                    # chain per half instead of one a lane: the same.)
                    for j in range(16):
                        builder.store(scale_words(j), words[j])
                    for p_, v in zip(q6_dd, scales()):
                        builder.store(v, p_)
                    fence(q6_words, q6_dd_arr)
                    for ch in range(8):
                        lane = offset(ch)
                        for h in range(2):
                            quad(lane, h, ch)
                        finish(ch, lane)
                        if ch < 7:      # each lane done before the next (4-8% faster)
                            fence()

            def fence(*vals):
                """An empty asm that may read and write memory: no load or store moves across it,
                and the values passed (vectors, or a pointer it then may reach) exist before it."""
                cons = ",".join("r" if isinstance(v.type, ir.PointerType) else "v" for v in vals)
                builder.asm(ir.FunctionType(ir.VoidType(), [v.type for v in vals]), "",
                            cons + ("," if vals else "") + "~{memory}", list(vals), True)

            pairs0 = builder.mul(anb, c(16))    # Q6_K: where isum's pairs of x-sums start
            n_acc = 2 if kind == Q4_K else 1 if kind == Q4_0 else 8
            in_memory = kind == Q6_K and n_tok > 1 and not batch
            if in_memory:
                # q6_block's scale words and d_x d_w, written once a block
                q6_words, q6_dd_arr = cgutils.alloca_once(builder, V32H, size=16), cgutils.alloca_once(builder, V16F, size=n_tok)
                q6_slots = [builder.gep(q6_words, [ir.Constant(I32, j)]) for j in range(16)]
                q6_dd = [builder.gep(q6_dd_arr, [ir.Constant(I32, t)]) for t in range(n_tok)]
                # Q6_K's four tokens: 32 float accumulators, all the registers; LLVM kept them in
                # registers across the block and spilled its working set around them (556 stack
                # references a block). Escaped to the fence (once a block and lane), they stay
                # in memory: a load and a store each a block.
                arr = cgutils.alloca_once(builder, V16F, size=n_tok * n_acc)
                acc = [[builder.gep(arr, [ir.Constant(I32, t * n_acc + l)]) for l in range(n_acc)] for t in range(n_tok)]
                for p_ in (p_ for row_ in acc for p_ in row_):
                    builder.store(ir.Constant(V16F, None), p_)
                fence(arr)
            else:
                acc = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, None)) for _ in range(n_acc)] for _ in range(n_tok)]
            prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
                                                      "llvm.prefetch.p0i8")
            low4, zero = ir.Constant(V64B, [15] * 64), ir.Constant(V16I, None)
            low16 = ir.Constant(V16I, [0xFFFF] * 16)
            if batch and kind in (Q5_0, Q8_0):
                # a batch: one chunk (one or two lanes) at a time over all blocks, so that only
                # those lanes' accumulators are live (each lane's order is the same); the
                # group's bytes are read from cache after the first chunk. (Not for the
                # streamed reads of decode: Q6_K's four-token checks that way took 3x longer.)
                for ch in range(8 if kind == Q8_0 else 4):
                    with cgutils.for_range(builder, anb) as loop:
                        legacy_lanes(loop.index, builder.add(gbase, builder.mul(loop.index, c(gb))), ch)
                anb = ir.Constant(anb.type, 0)       # the block loop below then does nothing
            with cgutils.for_range(builder, anb) as loop:
                b = loop.index
                o = builder.add(gbase, builder.mul(b, c(gb)))
                pending[:] = [(o, line) for line in range(0, gb if pf else 0, 64)]
                # all at the block's top, or (spread) one before each of its 64-byte loads and
                # the rest at the top: on the AMX row a burst of 37-53 held up the block's
                # loads and arithmetic, so that four tokens took the memory's time plus the
                # arithmetic's (see cpu.Kind)
                ahead(max(0, len(pending) - LOADS[kind]) if spread else len(pending))
                if in_memory:
                    fence()
                if kind == Q6_K and batch:
                    # llama.cpp's tiled batch kernel: the block's whole integer sum
                    # I = sum_j sc_j (q - 32) . x_j, then y = fma((I * d_w), d_x, y)
                    x0 = builder.mul(b, c(256))
                    ia = [zero] * n_tok
                    for h in range(2):
                        for half in range(2):
                            dots = [[zero] * n_tok for _ in range(4)]
                            for ch in range(4 * half, 4 * half + 4):
                                for s_, w in q6_values(o, h, ch):
                                    for t in range(n_tok):
                                        xo = builder.add(x0, c(128 * h + 32 * s_ + 4 * ch))
                                        dots[s_][t] = builder.call(dpbusd, [dots[s_][t], w, xword(t, xo)])
                            for s_ in range(4):
                                j = 8 * h + 2 * s_ + half          # the 16 values' scale and sum
                                sc = builder.sext(load(builder.add(o, c(3072 + 16 * j)), ir.VectorType(I8, 16)), V16I)
                                for t in range(n_tok):      # sum (q - 32) x = sum q x - 32 sum x (isum: 32 sum x)
                                    s32 = scalar(tis, aisum, t, lds, builder.add(builder.mul(b, c(16)), c(j)), I32)
                                    ia[t] = builder.add(ia[t], builder.mul(builder.sub(dots[s_][t], _splat(builder, s32, V16I)), sc))
                    d = halves16(builder.add(o, c(3328)))
                    for t in range(n_tok):
                        dx = _splat(builder, scalar(txd, axd, t, ldd, b, F32), V16F)
                        a = acc[t][0]
                        builder.store(builder.call(fma, [builder.fmul(builder.sitofp(ia[t], V16F), d), dx, builder.load(a)]), a)
                elif kind == Q6_K:
                    q6_block(b, o)
                elif kind == Q4_K:
                    # llama.cpp's q4_K 8x8 kernels: two chains, the scales' (d_w d_x times the
                    # scaled dots) and the mins' (dmin_w d_x times sum_j m_j * (x-sum of
                    # sub-block j)), subtracted at the end; the gemv adds once per block, the
                    # gemm (batch) once per pair of sub-blocks
                    x0 = builder.mul(b, c(256))

                    def meta(p):    # the scales of sub-blocks 2p, 2p + 1 as int32 lanes, and
                        # their mins as int16 pairs against the x-sums of those sub-blocks
                        # (isum holds int16 pairs here): vpdpwssd
                        two = load(builder.add(o, c(2176 + 32 * p)), ir.VectorType(I8, 32))
                        return (bytes16(builder.add(o, c(2048 + 32 * p))), bytes16(builder.add(o, c(2064 + 32 * p))),
                                builder.zext(builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(I32, 32), [i // 2 + 16 * (i % 2) for i in range(32)])), V32H))

                    def dmins():
                        return halves16(builder.add(o, c(2304))), halves16(builder.add(o, c(2336)))

                    # one token: the block's last 320 bytes (scales, mins, d, dmin) loaded first,
                    # so the loads that gate each quarter's products are in flight while the
                    # quants stream (Q4_K from memory on Zen 4: 19.1 -> 20.9 GB/s on 1 thread,
                    # 37.0 -> 41.6 on 2; loaded where used, the core waited on them). Four
                    # tokens: where used (36 -> 32 GB/s first: their accumulators need the registers).
                    early = not batch and n_tok == 1
                    metas, dm = ([meta(p) for p in range(4)], dmins()) if early else (None, None)

                    def scales():   # d_w d_x and dmin_w d_x of each token
                        d, dmin = dm if early else dmins()
                        dx = [_splat(builder, scalar(txd, axd, t, ldd, b, F32), V16F) for t in range(n_tok)]
                        return [builder.fmul(d, x) for x in dx], [builder.fmul(dmin, x) for x in dx]
                    ia, mins = [zero] * n_tok, [zero] * n_tok
                    for p in range(4):
                        if n_tok > 1:
                            # decode's four tokens: the quarter before done first, its sums the
                            # fence's operands (LLVM sank the scales' products to the block's
                            # end and spilled the four quarters' dots: 101 stack references a
                            # block -> 23; four tokens from cache 17.5 -> 19.8 GB/s, one thread)
                            fence(*(() if batch or not p else ia + mins))
                        dlo, dhi = [zero] * n_tok, [zero] * n_tok
                        for ch in range(8):
                            q = load(builder.add(o, c(64 * (8 * p + ch))), V64B)
                            lo, hi = builder.and_(q, low4), builder.lshr(q, ir.Constant(V64B, [4] * 64))
                            for t in range(n_tok):
                                dlo[t] = builder.call(dpbusd, [dlo[t], lo, xword(t, builder.add(x0, c(64 * p + 4 * ch)))])
                                dhi[t] = builder.call(dpbusd, [dhi[t], hi, xword(t, builder.add(x0, c(64 * p + 32 + 4 * ch)))])
                        sl, sh, mp = metas[p] if early else meta(p)
                        if batch:
                            dd, ddm = scales()
                        for t in range(n_tok):
                            ip = builder.add(builder.mul(dlo[t], sl), builder.mul(dhi[t], sh))
                            pair = scalar(tis, aisum, t, lds, builder.add(builder.mul(b, c(4)), c(p)), I32)
                            xp = builder.bitcast(_splat(builder, pair, V16I), V32H)
                            if batch:
                                mk = builder.call(dpwssd, [zero, mp, xp])
                                a, am = acc[t][0], acc[t][1]
                                builder.store(builder.call(fma, [builder.sitofp(ip, V16F), dd[t], builder.load(a)]), a)
                                builder.store(builder.call(fma, [builder.sitofp(mk, V16F), ddm[t], builder.load(am)]), am)
                            else:   # the mins' chain: one instruction a quarter (LLVM split it in two)
                                ia[t], mins[t] = builder.add(ia[t], ip), dpwssd_asm(mins[t], mp, xp)
                    if not batch:
                        dd, ddm = scales()
                        for t in range(n_tok):
                            a, am = acc[t][0], acc[t][1]
                            builder.store(builder.call(fma, [builder.sitofp(ia[t], V16F), dd[t], builder.load(a)]), a)
                            builder.store(builder.call(fma, [builder.sitofp(mins[t], V16F), ddm[t], builder.load(am)]), am)
                elif kind == Q4_0:
                    # llama.cpp's repacked q4_0 8x8 kernels: one chain, the block's whole
                    # integer dot times d_w * d_x
                    x0 = builder.mul(b, c(32))
                    d = halves16(builder.add(o, c(gb - 32)))
                    ia = [zero] * n_tok
                    for ch in range(4):
                        for _, u, v0 in legacy_runs(o, ch):
                            for t in range(n_tok):
                                ia[t] = builder.call(dpbusd, [ia[t], u, xword(t, builder.add(x0, c(v0)))])
                    for t in range(n_tok):
                        s32 = scalar(tis, aisum, t, lds, b, I32)      # isum: the sums per 32 here
                        v = builder.sub(ia[t], _splat(builder, builder.mul(s32, ir.Constant(I32, off)), V16I))
                        dd = builder.fmul(d, _splat(builder, scalar(txd, axd, t, ldd, b, F32), V16F))
                        a = acc[t][0]
                        builder.store(builder.call(fma, [builder.sitofp(v, V16F), dd, builder.load(a)]), a)
                else:
                    # llama.cpp's lanes (vec_dot / tinyBLAS over Q8_0 activations): lane l is the
                    # integer dot of values 4l..4l+3 of each block, d_w * d_x times it into lane l
                    for ch in range(8 if kind == Q8_0 else 4):
                        legacy_lanes(b, o, ch)
                ahead(len(pending))     # any left (none where LOADS is right)
            for t in range(n_tok):
                a = [builder.load(v) for v in acc[t]]
                if kind == Q4_K:
                    out = builder.fsub(a[0], a[1])
                elif (kind == Q6_K and batch) or kind == Q4_0:
                    out = a[0]
                else:       # hsum_float_8's order
                    out = builder.fadd(builder.fadd(builder.fadd(a[4], a[0]), builder.fadd(a[6], a[2])),
                                       builder.fadd(builder.fadd(a[5], a[1]), builder.fadd(a[7], a[3])))
                dst = _ptr(context, builder, ty, ay, builder.add(row(t, ldy), builder.mul(ag, c(16))), V16F)
                builder.store(out, dst, align=4)
            return context.get_dummy_value()
        return types.none(pk, g, nb, xq, xd, isum, y, t0), codegen
    return rows16


def _dispatch(n_tok, batch=False):
    """The kernel of each kind for n_tok[kind] tokens at a time: one (decode), two (TWO),
    four (verification of a few tokens, a batch) or eight (the Q8_0-activation kinds in a batch),
    chosen by an if-chain (numba cannot index a tuple of intrinsics at run time)."""
    q4_0, q5_0, q8_0, q4_K, q6_K = (_rows16(k, n_tok[k], batch) for k in range(5))

    @njit(inline="always")
    def group(kind, pk, g, nb, xq, xd, isum, y, t0):
        if kind == Q4_0:
            q4_0(pk, g, nb, xq, xd, isum, y, t0)
        elif kind == Q5_0:
            q5_0(pk, g, nb, xq, xd, isum, y, t0)
        elif kind == Q8_0:
            q8_0(pk, g, nb, xq, xd, isum, y, t0)
        elif kind == Q4_K:
            q4_K(pk, g, nb, xq, xd, isum, y, t0)
        else:
            q6_K(pk, g, nb, xq, xd, isum, y, t0)
    return group


LSTEP = cpu.KIND.batch_step     # tokens per batch kernel call: Q4_0, Q5_0, Q8_0 (a speed choice)
BATCH_STEP = (LSTEP, LSTEP, LSTEP, 4, 4)    # by kind (Q4_K, Q6_K: llama.cpp's fours)
_group1, _group4, _groupb = _dispatch((1,) * 5), _dispatch((4,) * 5), _dispatch(BATCH_STEP, True)
# Kinds with a two-token kernel: a speculative draft's forward of two tokens (the guess it did
# not feed and the target's, after a check that took every guess: 3 rounds in 4), whose
# matrices are Q4_0 (numba_cpu.DRAFT_Q4_0), took the four-token kernel with two zero tokens.
TWO = frozenset({Q4_0})
_group2 = _dispatch((2,) * 5)


# a group kernel's C signature (called through quant.intrin.call_c, an array as its data and
# length): pk, its bytes per group row, the groups [g0, g1), nb, xq and its rows T, xd, isum, y,
# nbatch
_GROUP_SIG = types.void(*c_array(types.uint8), types.int64, types.int64, types.int64, types.int64,
                        *c_array(types.int8), types.int64, *c_array(types.float32), *c_array(types.int32),
                        *c_array(types.float32), types.int64)
_kernels: dict[int, object] = {}      # kind -> its compiled group kernel (a numba cfunc)
# The CPU row the kernels' code follows (quant.cpu.KIND: prefetch distances and levels, batch
# step) as a number the group kernels close over: numba keys a cached function on its own
# code and closure, not on the modules its code generators read, so an edited row (a new
# prefetch distance) loaded the kernels compiled for the old one.
def plan(row: cpu.Kind) -> int:
    return zlib.crc32(repr(row).encode())


PLAN = plan(cpu.KIND)


def _kernel(kind: int):
    """The compiled kernel of one kind for a run of groups of 16 rows and all T tokens of xq: the
    first nbatch (a multiple of the kind's BATCH_STEP) by the batch kernels (Q4_0 on a CPU
    row with AMX: their multiple of 16 through tiles, quant.amx), the rest four at a time,
    then two (TWO) and one, by decode's. A C function of its own (numba's cfunc, cached), called
    through its address (quant.intrin.call_c) by the one parallel loop (_run): numba links a
    jit callee's code into every caller and optimizes and compiles it again there (a prange
    body four times over: gufunc, two wrappers, the caller), which was most of a kind's
    first-run compile. Not fastmath: LLVM would then be free to fuse or reorder the float
    steps differently in the 1- and 4-token kernels, and a token checked in a group must get
    the bits it gets alone."""
    if kind not in _kernels:
        step, row_plan = LSTEP if kind <= Q8_0 else 4, PLAN
        # The closure holds plain values only: numba keys a cached function on its closure's
        # pickle, and a dispatcher's carries a uuid of its process (a dispatcher here made
        # every process compile every kind again: 4 s of a warm `prompt Hi -n 1`).
        # `if tiled` on a closure constant is pruned before typing, so a kernel without tiles
        # never compiles quant.amx's (nor its instructions, on a CPU that lacks them).
        tiled = kind == Q4_0 and T.Q4_0 in cpu.KIND.amx
        two = kind in TWO

        def group(pk_, npk, row_bytes, g0, g1, nb, xq_, nxq, T, xd_, nxd, is_, nis, y_, ny, nbatch):
            if row_plan < 0:        # never: in the closure for the cache's key (see PLAN)
                return
            pk = numba.carray(pk_, (npk // row_bytes, row_bytes))
            xq, xd = numba.carray(xq_, (T, nxq // T)), numba.carray(xd_, (T, nxd // T))
            isum, y = numba.carray(is_, (T, nis // T)), numba.carray(y_, (T, ny // T))
            T4 = T // 4 * 4
            ntile = 0
            if tiled:       # a batch's multiple of 16 through AMX tiles, the same bits
                ntile = nbatch // amx.TOKENS * amx.TOKENS
                if ntile:
                    amx.q4_0(pk, g0, g1, nb, xq, xd, y, ntile)
            for g in range(g0, g1):
                for t0 in range(ntile, nbatch, step):
                    _groupb(kind, pk, g, nb, xq, xd, isum, y, t0)
                for t0 in range(nbatch, T4, 4):
                    _group4(kind, pk, g, nb, xq, xd, isum, y, t0)
                t1 = T4
                if two:     # (on its own line: pruned before typing where False, as tiled)
                    if T - T4 >= 2:
                        _group2(kind, pk, g, nb, xq, xd, isum, y, T4)
                        t1 = T4 + 2
                for t0 in range(t1, T):
                    _group1(kind, pk, g, nb, xq, xd, isum, y, t0)
        _kernels[kind] = numba.cfunc(_GROUP_SIG, cache=True)(group)
    return _kernels[kind]


@njit(parallel=True, cache=True)
def _run(fn, n, pk, nb, xq, xd, isum, y, nbatch):
    """y (T, rows) for the T tokens of xq: the group kernel at fn on runs of up to 16 groups,
    which the n threads take in turn (an atomic counter, as llama.cpp's chunks), so that a
    thread the host slows down does not keep the others waiting at the end of each matrix.
    A group's rows are the same arithmetic whichever thread computes them. (A call per group
    was 4-22% slower than a run per thread.)"""
    G = pk.shape[0]
    step = max(1, min(16, G // (4 * n)))
    taken = np.zeros(1, np.int64)
    for _ in prange(n):
        g0 = fetch_add(taken, step)
        while g0 < G:
            call_c(fn, pk, np.int64(pk.shape[1]), g0, min(G, g0 + step), np.int64(nb), xq,
                   np.int64(xq.shape[0]), xd, isum, y, np.int64(nbatch))
            g0 = fetch_add(taken, step)


def _matmul(kind: int):
    """The matmul of one kind: f(pk, nb, xq, xd, isum, y, nbatch) on numba's threads (for
    bench/packed_ab.py, which calls revisions' kernels by this name)."""
    fn = _kernel(kind).address
    return lambda *a: _run(fn, threads(), *a)


@njit(cache=True)
def _quantize_k(X, q4, m, xq, xd, bs16, bs32, sums):
    """The rows of X as Q8_K into the buffers' first rows, rows up to m zero (padding tokens);
    sums (int32): Q4_K's (q4) sums per 32 as int16 pairs (each at most 32 * 128; the low
    half first, as an int16 view of them reads), or Q6_K's offset 32 times the sums per 16
    and after them the sums per 16 as int16 pairs (each at most 16 * 128), one a lane of a block.
    One signature for both (one compilation on a first run); one call per matrix, so
    quantizing costs no Python per row."""
    n16 = bs16.shape[1]
    for i in range(X.shape[0]):
        quantize_x(X[i], xq[i], xd[i], bs16[i], bs32[i])
        if q4:
            for j in range(sums.shape[1]):
                sums[i, j] = (bs32[i, 2 * j] & 0xFFFF) | (bs32[i, 2 * j + 1] << 16)
        else:
            for j in range(n16):
                sums[i, j] = 32 * bs16[i, j]
            for j in range(n16 // 2):
                sums[i, n16 + j] = (bs16[i, 2 * j] & 0xFFFF) | (bs16[i, 2 * j + 1] << 16)
    for i in range(X.shape[0], m):
        xq[i], xd[i], sums[i] = 0, 0, 0


@njit(cache=True)
def _quantize_0(X, m, xq, xd, xs, s32, sums, off):
    """The rows of X as Q8_0, rows up to m zero; sums: -off times the sums per 4 values (the
    kernels' lanes start their dots there: one broadcast load, no multiply) or, off 0, the
    sums per 32 (Q4_0's whole blocks)."""
    for i in range(X.shape[0]):
        quantize_q8_0(X[i], xq[i], xd[i], xs, s32)
        if off:
            for j in range(sums.shape[1]):
                sums[i, j] = -off * (np.int32(xq[i, 4 * j]) + np.int32(xq[i, 4 * j + 1]) + np.int32(xq[i, 4 * j + 2]) + np.int32(xq[i, 4 * j + 3]))
        else:       # a loop: a slice assignment from an array compiled numba's string
            for j in range(s32.shape[0]):     # formatting for its shape error (2.4 s)
                sums[i, j] = s32[j]
    for i in range(X.shape[0], m):
        xq[i], xd[i], sums[i] = 0, 0, 0


_bufs: dict[tuple, tuple] = {}


def _quantized(p: Packed, X: np.ndarray, m: int):
    """X (T, cols) as the kernels read it, padded with zero rows to m >= T: views of m rows
    of xq, xd and the sums (see _quantize_k; Q5_0/Q8_0: -offset times the sums per 4, Q4_0
    the sums per 32), and the blocks per row. The buffers grow to the largest m asked for, once."""
    quantize, args, v = _buffers(p, m)
    quantize(X, *args)
    return v


def _buffers(p: Packed, m: int):
    """The quantizer of p's kind, its arguments after X (m rows into the buffers) and the
    views _quantized returns."""
    key = (p.kind, p.cols)
    b = _bufs.get(key)
    c, k = p.cols, p.kind in (Q4_K, Q6_K)
    if b is None or b[0].shape[0] < m:
        z = lambda n, t: np.zeros((max(ROWS, m), n), t)
        if k:       # xq, xd, sums per 16 and per 32, the kernel's sums (Q4_K: int16 pairs)
            b = (z(c, np.int8), z(c // 256, np.float32), z(c // 16, np.int32), z(c // 32, np.int32),
                 z(c // 64, np.int32) if p.kind == Q4_K else z(c // 16 + c // 32, np.int32), {})
        else:       # xq, xd, Q8_1's s and the sums per 32 (unused), the sums per 4
            b = (z(c, np.int8), z(c // 32, np.float32), np.zeros(c // 32, np.float32), np.zeros(c // 32, np.int32),
                 z(c // 4, np.int32), {})
        _bufs[key] = b
    xq, xd, s1, s2, sums, views = b
    v = views.get(m)
    if v is None:
        v = views[m] = (xq[:m], xd[:m], sums[:m], c // (256 if k else 32))
    if k:
        return _quantize_k, (p.kind == Q4_K, m, xq, xd, s1, s2, sums), v
    return _quantize_0, (m, xq, xd, s1, s2, sums, 0 if p.kind == Q4_0 else LAYOUT[p.kind][2]), v


_ybuf: dict[int, np.ndarray] = {}


def batch_tokens(kind: int, n: int) -> int:
    """How many of n tokens go to the batch kernels (the rest get decode's float order):
    llama.cpp's Q4_K gemm takes whole fours (the rest go through its gemv), Q6_K's tiled
    kernel all of a batch of 8 or more; the Q8_0-activation kinds have one order for all."""
    if kind == Q4_K:
        return n - n % 4
    if kind == Q6_K:
        return -(-n // 4) * 4 if n >= 8 else 0
    return n - n % LSTEP    # the same order either way: LSTEP at a time only for speed


def padded(kind: int, n: int) -> int:
    """The tokens the kernels of kind run for n: above one, a multiple of four (TWO: of
    two), the rest zero tokens."""
    step = 2 if kind in TWO else 4
    return n if n == 1 else -(-n // step) * step


def matmul_rows(p: Packed, X: np.ndarray, Y: np.ndarray, batch: bool = True, rounded: dict | None = None) -> None:
    """Y (T, rows) for X (T, cols), with the float steps of llama.cpp's kernels for a batch of
    T (batch) or, for every row, those of a single token (decode; speculative verification).
    Above one token the kernels take four at a time, each group of weights read once; T
    that is not a multiple of four (TWO: of two) is padded with zero tokens (cheaper than
    more reads).
    rounded: a dict shared by the calls that multiply the same X (Q, K and V; gate and up),
    so that X is quantized once per kind for them."""
    if X.shape[1] != p.cols:
        raise ValueError(f"{T(p.type_id).name}: {p.cols} inputs expected, got {X.shape[1]}")
    n = X.shape[0]
    if n <= ROWS and rounded is None and Y.flags.c_contiguous:
        # decode, a speculative check, a draft's two tokens: ~100 calls a forward, the same two
        # kernels with their arguments bound once (this function's other steps cost 2-3 us a
        # call with hot caches, 2-3x that in a step)
        bound = p.bound.get((n, batch))
        if bound is None:
            m = padded(p.kind, n)
            quantize, args, (xq, xd, isum, nb) = _buffers(p, m)
            bound = p.bound[(n, batch)] = (quantize, args, _kernel(p.kind).address, p.data, nb, xq, xd, isum,
                                           batch_tokens(p.kind, n) if batch else 0, None if m == n else _ypad(p, m))
        quantize, args, fn, data, nb, xq, xd, isum, nbatch, pad = bound
        quantize(X, *args)
        _run(fn, threads(), data, nb, xq, xd, isum, Y if pad is None else pad, nbatch)
        if pad is not None:
            Y[:] = pad[:n]
        return
    m = padded(p.kind, n)
    key = ("packed", p.kind)
    xq, xd, isum, nb = rounded[key] if rounded is not None and key in rounded else _quantized(p, X, m)
    if rounded is not None:     # views of this kind's buffers, untouched until X changes
        rounded[key] = xq, xd, isum, nb
    nbatch = batch_tokens(p.kind, n) if batch else 0
    if m == n and Y.flags.c_contiguous:     # the kernels write through flat offsets
        _run(_kernel(p.kind).address, threads(), p.data, nb, xq, xd, isum, Y, nbatch)
        return
    Yp = _ypad(p, m)
    _run(_kernel(p.kind).address, threads(), p.data, nb, xq, xd, isum, Yp, nbatch)
    Y[:] = Yp[:n]


# placeholders for the buffers one quantizer kind does not use (decode_args: one type for all)
_NONE_F, _NONE_I, _NONE_I2 = np.zeros(1, np.float32), np.zeros(1, np.int32), np.zeros((1, 1), np.int32)


def decode_args(p: Packed, fn: int | None = None) -> tuple:
    """p's one-token product (decode's steps) as decode_matvec takes it: the quantizer's kind and
    buffers, then the group kernel's address, p's groups and the quantized views. Every kind
    gives a tuple of the same numba type, so a compiled caller (runner.backends.numba_cpu's
    decode layer) is compiled once for all. fn: the kernel's address (0 to run no group:
    p.data then has none)."""
    quantize, args, (xq, xd, isum, nb) = _buffers(p, 1)
    fn = _kernel(p.kind).address if fn is None else fn
    if quantize is _quantize_k:
        q4, m, xq_, xd_, bs16, bs32, sums = args
        return (True, q4, m, xq_, xd_, _NONE_F, _NONE_I, bs16, bs32, sums, 0, fn, p.data, nb, xq, xd, isum)
    m, xq_, xd_, xs, s32, sums, off = args
    return (False, False, m, xq_, xd_, xs, s32, _NONE_I2, _NONE_I2, sums, off, fn, p.data, nb, xq, xd, isum)


@njit(cache=True)
def decode_matvec(X, Y, M, nth):
    """Y (1, rows) = X (1, cols) W^T with a decode_args tuple M: matmul_rows's bound path for one
    token (batch=False), as one compiled call."""
    k, q4, m, xq_, xd_, xs, s32, bs16, bs32, sums, off, fn, data, nb, xq, xd, isum = M
    if k:
        _quantize_k(X, q4, m, xq_, xd_, bs16, bs32, sums)
    else:
        _quantize_0(X, m, xq_, xd_, xs, s32, sums, off)
    _run(fn, nth, data, nb, xq, xd, isum, Y, 0)


def _ypad(p: Packed, m: int) -> np.ndarray:
    """m rows of output for p's padded tokens (the buffer grows to the largest m, once)."""
    Yp = _ybuf.get(p.rows)
    if Yp is None or Yp.shape[0] < m:
        Yp = _ybuf[p.rows] = np.empty((max(ROWS, m), p.rows), np.float32)
    return Yp[:m]


def matvec(p: Packed, x: np.ndarray, y: np.ndarray) -> None:
    matmul_rows(p, x[None], y[None])


QUANTIZERS = (T.Q8_0, T.Q4_K)    # _quantize_0; _quantize_k (Q6_K's too: one signature)


def quantizer_types(kinds) -> set[int]:
    """The activation quantizers (of QUANTIZERS) that the matmuls of kinds take their input
    from, one type per compiled kernel (Q4_K's compiles Q6_K's: the same function)."""
    return {T.Q8_0 if k <= Q8_0 else T.Q4_K for k in kinds}


def precompile_repack() -> None:
    """Compile (or load) _repack for the read-only blocks of a mapped file (a first run's
    helper compiles it while the model downloads: its load then repacks at once)."""
    bs, gb, _, _ = LAYOUT[Q8_0]
    raw = np.zeros((16, bs), np.uint8)
    raw.flags.writeable = False
    _repack(raw, Q8_0, np.zeros((1, gb), np.uint8), 0, 1)


def precompile(kinds, quantizers, run: bool = False) -> None:
    """Compile (or load) the group kernels of kinds, the activation quantizers of the given
    types and (run) the parallel loop over groups, every signature a model's forward calls
    them with (the first run shares them between two processes:
    runner.backends.numba_cpu.FirstRun)."""
    for t in QUANTIZERS:
        if t in quantizers:
            _, gb, _, nv = LAYOUT[KINDS[t]]
            _quantized(Packed(t, np.zeros((1, gb), np.uint8), 16, nv), np.zeros((1, nv), np.float32), 1)
    for kind in kinds:
        _kernel(kind)
    if run:         # no groups: the kernel address is never called
        _run(0, 1, np.zeros((0, 16), np.uint8), 1, np.zeros((1, 32), np.int8), np.zeros((1, 1), np.float32),
             np.zeros((1, 8), np.int32), np.zeros((1, 16), np.float32), 0)
