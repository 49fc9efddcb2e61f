"""16/32-bit integer operations for the kernels' inner loops, and the float bit tricks that
keep elementwise loops (exp, f16 rounding) vectorizable.

numba types int16*int16 and int32*int32 as int64, and LLVM does not always narrow that back
(it may drop the truncations and vectorize 64-bit lanes). These intrinsics emit the narrow
operations directly, so a lane loop becomes vpmovzxbw / vpmullw / vpdpwssd.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quant.cpu import KIND


def _int_op(ty, op):
    @intrinsic
    def f(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])
        return ty(ty, ty), codegen
    return f


_mul16 = _int_op(types.int16, "mul")
_mul32 = _int_op(types.int32, "mul")
_add32 = _int_op(types.int32, "add")
_or16 = _int_op(types.int16, "or_")


@intrinsic
def _field(typingctx, byte, shift, mask, up):
    """((byte >> shift) & mask) << up in int16: a quant field of a byte, moved into place."""
    def codegen(context, builder, sig, args):
        b, s, m, u = args
        return builder.shl(builder.and_(builder.lshr(b, s), m), u)
    t = types.int16
    return t(t, t, t, t), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """a*b + c in float32 with one rounding (llvm.fma), as the _mm512_fmadd_ps it mirrors."""
    def codegen(context, builder, sig, args):
        t = args[0].type
        f = builder.module.declare_intrinsic("llvm.fma", [t], ir.FunctionType(t, [t, t, t]))
        return builder.call(f, args)
    t = types.float32
    return t(t, t, t), codegen


@intrinsic
def f32_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.int32))
    return types.int32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, i):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


@intrinsic
def fma64(typingctx, a, b, c):
    """a*b + c in float64 with one rounding."""
    def codegen(context, builder, sig, args):
        t = args[0].type
        return builder.call(builder.module.declare_intrinsic("llvm.fma", [t], ir.FunctionType(t, [t, t, t])), args)
    t = types.float64
    return t(t, t, t), codegen


@intrinsic
def f64_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def bits_f64(typingctx, i):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@intrinsic
def h2f(typingctx, h):
    """The float16 whose bits are h (uint16), as float32 (vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def f2h(typingctx, x):
    """The bits of float32 x rounded to the nearest float16, ties to even (vcvtps2ph), as
    numpy's astype(float16): the f16 KV cache's stores."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


def _splat(builder, value, vty):
    """value in every lane of a vector of type vty (insertelement + shufflevector: vbroadcast)."""
    i32 = ir.IntType(32)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(i32, vty.count), [0] * vty.count))


def _vec_ptr(context, builder, arrty, arr, offset):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ir.FloatType(), 16).as_pointer())


def _load16(context, builder, arrty, arr, offset):
    """16 floats from a flat float32 array, or 16 float16 (uint16 bits) widened to float32:
    the f16 KV cache is read in place, never copied out."""
    data = context.make_array(arrty)(context, builder, arr).data
    if arrty.dtype == types.uint16:
        h16 = ir.VectorType(ir.IntType(16), 16)
        x = builder.load(builder.bitcast(builder.gep(data, [offset]), h16.as_pointer()), align=2)
        return builder.fpext(builder.bitcast(x, ir.VectorType(ir.HalfType(), 16)), ir.VectorType(ir.FloatType(), 16))
    return builder.load(builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ir.FloatType(), 16).as_pointer()), align=4)


def _fma16(half: bool):
    @intrinsic
    def f(typingctx, acc, ai, x, xi, s):
        def codegen(context, builder, sig, args):
            aacc, aai, ax, axi, as_ = args
            v16 = ir.VectorType(ir.FloatType(), 16)
            pa = _vec_ptr(context, builder, sig.args[0], aacc, aai)
            splat = _splat(builder, as_, v16)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.fma.v16f32")
            r = builder.call(fma, [_load16(context, builder, sig.args[2], ax, axi), splat, builder.load(pa, align=4)])
            if half:
                r = builder.fpext(builder.fptrunc(r, ir.VectorType(ir.HalfType(), 16)), v16)
            builder.store(r, pa, align=4)
            return context.get_dummy_value()
        return types.none(acc, ai, x, xi, types.float32), codegen
    return f


# acc[ai:ai+16] = fma(x[xi:xi+16], s, acc[ai:ai+16]) on flat arrays (x float32 or float16 bits):
# one 16-lane vfmadd whatever LLVM would make of the scalar loop (it keeps such loops scalar
# when it cannot rule out that acc and x overlap). fma16h rounds the sums to f16 (kept as
# float32): ggml_vec_mad_f16's step, flash attention's f16 value sums.
fma16, fma16h = _fma16(False), _fma16(True)


@intrinsic
def mul16(typingctx, out, oi, x, xi, s):
    """out[oi:oi+16] = x[xi:xi+16] * s on flat float32 arrays (fma16 onto zeros, bit for bit)."""
    def codegen(context, builder, sig, args):
        ao, aoi, ax, axi, as_ = args
        v16 = ir.VectorType(ir.FloatType(), 16)
        splat = _splat(builder, as_, v16)
        vx = _load16(context, builder, sig.args[2], ax, axi)
        builder.store(builder.fmul(vx, splat), _vec_ptr(context, builder, sig.args[0], ao, aoi), align=4)
        return context.get_dummy_value()
    return types.none(out, oi, x, xi, types.float32), codegen


@intrinsic
def add16(typingctx, out, oi, a, ai, b, bi):
    """out[oi:oi+16] = a[ai:ai+16] + b[bi:bi+16] on flat float32 arrays, one 16-lane add."""
    def codegen(context, builder, sig, args):
        ao, aoi, aa, aai, ab, abi = args
        va = builder.load(_vec_ptr(context, builder, sig.args[2], aa, aai), align=4)
        vb = builder.load(_vec_ptr(context, builder, sig.args[4], ab, abi), align=4)
        builder.store(builder.fadd(va, vb), _vec_ptr(context, builder, sig.args[0], ao, aoi), align=4)
        return context.get_dummy_value()
    return types.none(out, oi, a, ai, b, bi), codegen


def pv_tile(d: int):
    """An intrinsic pv(v, vo, w, wo, acc, ao): acc[ao:ao+d] += the 64 rows v[vo + c*d : +d]
    (f16 bits) times w[wo + c], c = 0..63 in order, one fma per value as flash attention's
    tile adds them (float32 chains over the cells); the d/16 vector chains are kept in
    registers and interleaved cell by cell, where the loop over a row kept them in memory."""
    @intrinsic
    def pv(typingctx, v, vo, w, wo, acc, ao):
        def codegen(context, builder, sig, args):
            av, avo, aw, awo, aacc, aao = args
            v16, i64 = ir.VectorType(ir.FloatType(), 16), avo.type
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.fma.v16f32")
            wdata = context.make_array(sig.args[2])(context, builder, aw).data
            ptrs = [_vec_ptr(context, builder, sig.args[4], aacc, builder.add(aao, ir.Constant(aao.type, 16 * b))) for b in range(d // 16)]
            accs = [builder.load(p, align=4) for p in ptrs]
            for c in range(64):
                x = builder.load(builder.gep(wdata, [builder.add(awo, ir.Constant(awo.type, c))]))
                ws = _splat(builder, x, v16)
                for b in range(d // 16):
                    row = _load16(context, builder, sig.args[0], av, builder.add(avo, ir.Constant(i64, c * d + 16 * b)))
                    accs[b] = builder.call(fma, [row, ws, accs[b]])
            for p, a in zip(ptrs, accs):
                builder.store(a, p, align=4)
            return context.get_dummy_value()
        return types.none(v, vo, w, wo, acc, ao), codegen
    return pv


def scores16(d: int, lanes: int):
    """An intrinsic scores(kf, ko, cap, qf, qo, out, oo): the dot products of one query
    qf[qo:qo+d] with 16 keys, key i's dim j at kf[ko + j*cap + i], summed as llama.cpp's f16
    dots sum (see runner.backends.kernels.attention): lanes = 16, one fma chain per lane j % 16
    (tinyBLAS); lanes = 64, chains j % 64 folded (0 + 2) + (1 + 3) (ggml_vec_dot_f16); then
    _mm512_reduce_add_ps's tree. 16 keys at once: each value below is a vector over the keys,
    and every chain stays in registers. Written to out[oo:oo+16]. lanes = 1 (simd_gemm, flash
    attention's tiles): a tile's 64 keys ko .. ko+63 into out[oo:oo+64], each score one chain
    over the dims in order, the four blocks' chains interleaved dim by dim so that the core
    overlaps them (one chain of d dependent fmas is latency-bound)."""
    @intrinsic
    def scores(typingctx, kf, ko, cap, qf, qo, out, oo):
        def codegen(context, builder, sig, args):
            akf, ako, acap, aqf, aqo, aout, aoo = args
            v16 = ir.VectorType(ir.FloatType(), 16)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.fma.v16f32")
            qdata = context.make_array(sig.args[3])(context, builder, aqf).data

            def key(j, kb=0):
                o = builder.add(ako, builder.mul(acap, ir.Constant(acap.type, j)))
                return _load16(context, builder, sig.args[0], akf, builder.add(o, ir.Constant(acap.type, 16 * kb)) if kb else o)

            def qsplat(j):
                x = builder.load(builder.gep(qdata, [builder.add(aqo, ir.Constant(aqo.type, j))]))
                return _splat(builder, x, v16)

            def chain(r):       # lane r: dims r, r + lanes, ...
                if r >= d:
                    return ir.Constant(v16, None)
                acc = builder.fmul(key(r), qsplat(r))
                for j in range(r + lanes, d, lanes):
                    acc = builder.call(fma, [key(j), qsplat(j), acc])
                return acc

            if lanes == 1:      # the tile's four blocks of 16 keys, chains side by side
                accs = [None] * 4
                for j in range(d):
                    qj = qsplat(j)
                    for kb in range(4):
                        accs[kb] = builder.fmul(key(j, kb), qj) if j == 0 else builder.call(fma, [key(j, kb), qj, accs[kb]])
                for kb, a in enumerate(accs):
                    builder.store(a, _vec_ptr(context, builder, sig.args[5], aout, builder.add(aoo, ir.Constant(aoo.type, 16 * kb))), align=4)
                return context.get_dummy_value()
            if lanes == 16:
                x = [chain(r) for r in range(16)]
            else:
                x = [builder.fadd(builder.fadd(chain(r), chain(32 + r)), builder.fadd(chain(16 + r), chain(48 + r))) for r in range(16)]
            for half in (8, 4, 2, 1):
                x = [builder.fadd(x[r], x[r + half]) for r in range(half)]
            builder.store(x[0], _vec_ptr(context, builder, sig.args[5], aout, aoo), align=4)
            return context.get_dummy_value()
        return types.none(kf, ko, cap, qf, qo, out, oo), codegen
    return scores


@intrinsic
def pv16(typingctx, v, vo, vrow, n, w, wo, lanes, out, oo, ostride, table, pstride):
    """Weights w[wo + s] times 16 columns of slot s's row of v, for the logical slots s < n (n
    a multiple of 16), summed in lanes (16 or 64) fma chains, lane s % lanes, slots in order:
    16 lanes at a time kept in registers. Slot s lives in page table[s // 64], row s % 64
    (16 slots in a row never cross a page), at v[vo + page*pstride + (s % 64)*vrow : +16].
    Lane l's sums go to out[oo + l*ostride : +16]."""
    def codegen(context, builder, sig, args):
        av, avo, avr, an, aw, awo, alanes, aout, aoo, aos, atab, aps = args
        v16 = ir.VectorType(ir.FloatType(), 16)
        i64 = avo.type
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.fma.v16f32")
        wdata = context.make_array(sig.args[4])(context, builder, aw).data
        tdata = context.make_array(sig.args[10])(context, builder, atab).data
        accs = [cgutils.alloca_once(builder, v16) for _ in range(16)]
        n_groups = builder.sdiv(alanes, ir.Constant(i64, 16))
        with cgutils.for_range(builder, n_groups) as gl:
            g0 = builder.mul(gl.index, ir.Constant(i64, 16))
            for a in accs:
                builder.store(ir.Constant(v16, None), a)
            # s0 = g0, g0 + lanes, ... < n
            steps = builder.sdiv(builder.add(builder.sub(an, g0), builder.sub(alanes, ir.Constant(i64, 1))), alanes)
            with cgutils.for_range(builder, steps) as sl:
                s0 = builder.add(g0, builder.mul(sl.index, alanes))
                page = builder.load(builder.gep(tdata, [builder.ashr(s0, ir.Constant(i64, 6))]))   # int64 table
                base = builder.add(avo, builder.add(builder.mul(page, aps), builder.mul(builder.and_(s0, ir.Constant(i64, 63)), avr)))
                for r in range(16):
                    s = builder.add(s0, ir.Constant(i64, r))
                    x = _load16(context, builder, sig.args[0], av, builder.add(base, builder.mul(ir.Constant(i64, r), avr)))
                    wt = builder.load(builder.gep(wdata, [builder.add(awo, s)]))
                    splat = _splat(builder, wt, v16)
                    builder.store(builder.call(fma, [x, splat, builder.load(accs[r])]), accs[r])
            for r in range(16):
                dst = builder.add(aoo, builder.mul(builder.add(g0, ir.Constant(i64, r)), aos))
                builder.store(builder.load(accs[r]), _vec_ptr(context, builder, sig.args[7], aout, dst), align=4)
        return context.get_dummy_value()
    return types.none(v, vo, vrow, n, w, wo, lanes, out, oo, ostride, table, pstride), codegen


@intrinsic
def mul16h(typingctx, acc, ai, s):
    """acc[ai:ai+16] = f16(acc[ai:ai+16] * s) as float32: ggml_vec_scale_f16's step."""
    def codegen(context, builder, sig, args):
        aacc, aai, as_ = args
        v16 = ir.VectorType(ir.FloatType(), 16)
        pa = _vec_ptr(context, builder, sig.args[0], aacc, aai)
        splat = _splat(builder, as_, v16)
        r = builder.fmul(builder.load(pa, align=4), splat)
        builder.store(builder.fpext(builder.fptrunc(r, ir.VectorType(ir.HalfType(), 16)), v16), pa, align=4)
        return context.get_dummy_value()
    return types.none(acc, ai, types.float32), codegen


def _dotq_row(q4: bool):
    """An intrinsic f(k, ko, qq, qo, qd, qdo, nb) -> float32: ggml_vec_dot_q8_0_q8_0 (or
    _q4_0_q8_0) of one row of nb blocks in its AVX2 steps, the sums kept in registers. k: uint8
    bytes, block b at k[ko + b * size] (its f16 scale, then q8_0: 32 int8 codes; q4_0: 16
    bytes, element j < 16 the low nibble of byte j, j >= 16 the high one of byte j - 16, minus
    8); qq: int8 codes of q at qq[qo:], its block scales qd[qdo:]. Per block the 32 products
    (exact in int16) are summed 4 at a time into 8 int32 lanes, each lane fma'd with
    d_k * d_q into its own sum; then hsum_float_8's order."""
    size = 18 if q4 else 34

    @intrinsic
    def f(typingctx, k, ko, qq, qo, qd, qdo, nb):
        def codegen(context, builder, sig, args):
            ak, ako, aqq, aqo, aqd, aqdo, anb = args
            i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
            V = lambda t, n: ir.VectorType(t, n)
            idx = lambda xs: ir.Constant(V(i32, len(xs)), list(xs))
            v8 = V(f32, 8)
            kdata = context.make_array(sig.args[0])(context, builder, ak).data
            qdata = context.make_array(sig.args[2])(context, builder, aqq).data
            ddata = context.make_array(sig.args[4])(context, builder, aqd).data
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]), "llvm.fma.v8f32")
            if KIND.vnni:
                ab = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V(i8, 32), [V(i8, 32), ir.IntType(1)]), "llvm.abs.v32i8")
                sg = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V(i8, 32), [V(i8, 32)] * 2), "llvm.x86.avx2.psign.b")
                dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V(i32, 8), [V(i32, 8), V(i8, 32), V(i8, 32)]),
                                                    "llvm.x86.avx512.vpdpbusd.256")
            accp = cgutils.alloca_once_value(builder, ir.Constant(v8, [0.0] * 8))   # a register after mem2reg
            with cgutils.for_range(builder, anb) as loop:
                b = loop.index
                off = lambda base, c: builder.add(base, builder.mul(b, ir.Constant(b.type, c)))   # base + b * c
                kp = builder.gep(kdata, [off(ako, size)])
                dk = builder.fpext(builder.load(builder.bitcast(kp, ir.HalfType().as_pointer()), align=1), f32)
                dd = builder.fmul(dk, builder.load(builder.gep(ddata, [off(aqdo, 1)]), align=4))
                cp = builder.gep(kdata, [builder.add(off(ako, size), ir.Constant(ako.type, 2))])
                if q4:
                    x = builder.load(builder.bitcast(cp, V(i8, 16).as_pointer()), align=1)
                    lo = builder.and_(x, ir.Constant(V(i8, 16), [15] * 16))
                    hi = builder.lshr(x, ir.Constant(V(i8, 16), [4] * 16))
                    kv = builder.sub(builder.shuffle_vector(lo, hi, idx(range(32))), ir.Constant(V(i8, 32), [8] * 32))
                else:
                    kv = builder.load(builder.bitcast(cp, V(i8, 32).as_pointer()), align=1)
                qv = builder.load(builder.bitcast(builder.gep(qdata, [off(aqo, 32)]), V(i8, 32).as_pointer()), align=1)
                if KIND.vnni:     # |k| times q with k's sign (codes are never -128): 4 products a lane
                    p = builder.call(dp, [ir.Constant(V(i32, 8), [0] * 8), builder.call(ab, [kv, ir.Constant(ir.IntType(1), 0)]),
                                          builder.call(sg, [qv, kv])])
                else:
                    p = builder.sext(builder.mul(builder.sext(kv, V(i16, 32)), builder.sext(qv, V(i16, 32))), V(i32, 32))
                    p = builder.add(builder.shuffle_vector(p, p, idx(range(0, 32, 2))), builder.shuffle_vector(p, p, idx(range(1, 32, 2))))
                    p = builder.add(builder.shuffle_vector(p, p, idx(range(0, 16, 2))), builder.shuffle_vector(p, p, idx(range(1, 16, 2))))
                splat = _splat(builder, dd, v8)
                builder.store(builder.call(fma, [splat, builder.sitofp(p, v8), builder.load(accp)]), accp)
            acc = builder.load(accp)
            a = [builder.extract_element(acc, ir.Constant(i32, j)) for j in range(8)]
            return builder.fadd(builder.fadd(builder.fadd(a[4], a[0]), builder.fadd(a[6], a[2])),
                                builder.fadd(builder.fadd(a[5], a[1]), builder.fadd(a[7], a[3])))
        return types.float32(k, ko, qq, qo, qd, qdo, nb), codegen
    return f


dotq8_row, dotq4_row = _dotq_row(False), _dotq_row(True)


def c_array(t):
    """An array of element type t in the C signature of a function called through call_c: its
    data pointer and its length."""
    return types.CPointer(t), types.int64


@intrinsic
def fetch_add(typingctx, counter, value):
    """counter[0] += value as one atomic step, returning the value before: how the threads of
    a parallel loop take work in turn."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", arr.data, args[1], "monotonic")
    return types.int64(counter, types.int64), codegen


@intrinsic
def call_c(typingctx, fn, *args):
    """Call the C function at address fn (a numba cfunc's .address) with args: an array as
    its data pointer and its length (C-contiguous only: the callee reads it flat), any other
    value as it is. A kernel's heavy body compiled once as a cfunc and called so from a
    parallel loop is not linked, optimized and compiled again in the loop's gufunc, its two
    wrappers and the caller, as a jit callee is (most of a prange kernel's first-run compile)."""
    if any(isinstance(a, types.Array) and a.layout != "C" for a in args):
        return None

    def codegen(context, builder, sig, llargs):
        out = []
        for ty, a in zip(args, cgutils.unpack_tuple(builder, llargs[1])):
            if isinstance(ty, types.Array):
                arr = context.make_array(ty)(context, builder, a)
                out += [arr.data, arr.nitems]
            else:
                out.append(a)
        fnty = ir.FunctionType(ir.VoidType(), [v.type for v in out])
        builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), out)
        return context.get_dummy_value()
    return types.none(fn, types.StarArgTuple.from_types(args)), codegen
