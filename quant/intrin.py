"""16/32-bit integer operations for the kernels' inner loops.

numba types int16*int16 and int32*int32 as int64, and LLVM does not always narrow that back
(it may drop the truncations and vectorize 64-bit lanes). These intrinsics emit the narrow
operations directly, so a lane loop becomes vpmovzxbw / vpmullw / vpdpwssd.
"""
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
