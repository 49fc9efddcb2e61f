"""16/32-bit integer operations for the kernels' inner loops, and the float bit tricks that
keep elementwise loops (exp, f16 rounding) vectorizable.

numba types int16*int16 and int32*int32 as int64, and LLVM does not always narrow that back
(it may drop the truncations and vectorize 64-bit lanes). These intrinsics emit the narrow
operations directly, so a lane loop becomes vpmovzxbw / vpmullw / vpdpwssd.
"""
from llvmlite import ir
from numba import types
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
