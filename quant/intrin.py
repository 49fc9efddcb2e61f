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


def _vec_ptr(context, builder, arrty, arr, offset):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ir.FloatType(), 16).as_pointer())


@intrinsic
def fma16(typingctx, acc, ai, x, xi, s):
    """acc[ai:ai+16] = fma(x[xi:xi+16], s, acc[ai:ai+16]) on flat float32 arrays: one 16-lane
    vfmadd whatever LLVM would make of the scalar loop (it keeps such loops scalar when it
    cannot rule out that acc and x overlap)."""
    def codegen(context, builder, sig, args):
        aacc, aai, ax, axi, as_ = args
        v16 = ir.VectorType(ir.FloatType(), 16)
        pa = _vec_ptr(context, builder, sig.args[0], aacc, aai)
        px = _vec_ptr(context, builder, sig.args[2], ax, axi)
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v16, ir.Undefined), as_, ir.Constant(ir.IntType(32), 0)),
                                       ir.Constant(v16, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.fma.v16f32")
        builder.store(builder.call(f, [builder.load(px, align=4), splat, builder.load(pa, align=4)]), pa, align=4)
        return context.get_dummy_value()
    return types.none(acc, ai, x, xi, types.float32), codegen


@intrinsic
def mul16(typingctx, out, oi, x, xi, s):
    """out[oi:oi+16] = x[xi:xi+16] * s on flat float32 arrays (fma16 onto zeros, bit for bit)."""
    def codegen(context, builder, sig, args):
        ao, aoi, ax, axi, as_ = args
        v16 = ir.VectorType(ir.FloatType(), 16)
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v16, ir.Undefined), as_, ir.Constant(ir.IntType(32), 0)),
                                       ir.Constant(v16, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        vx = builder.load(_vec_ptr(context, builder, sig.args[2], ax, axi), align=4)
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
