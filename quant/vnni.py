"""AVX512-VNNI block dots: vpdpbusd multiplies 64 unsigned bytes (weights) by 64 signed bytes
(8-bit activations) and adds each group of four products into one of 16 int32 lanes, in one
instruction. LLVM does not form it from numba's scalar loops (it widens to vpdpwssd), so the
intrinsics below emit it directly, on whole 64-value runs of a block.

Only for CPUs that have it (quant.cpu.KIND.vnni); the kernels in kquants fall back to their
portable form elsewhere (and LLVM would refuse to compile these). The integer sums are exact,
so a kernel built on them returns the same bits as the portable one.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I32 = ir.IntType(8), ir.IntType(32)
V32B, V64B, V16I = ir.VectorType(I8, 32), ir.VectorType(I8, 64), ir.VectorType(I32, 16)


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def _const(vty, v):
    return ir.Constant(vty, [v] * vty.count)


def _load(context, builder, arrty, arr, offset, vty):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.load(builder.bitcast(builder.gep(data, [offset]), vty.as_pointer()), align=1)


def _dpbusd(builder, acc, a, b):
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16I, [V16I, V64B, V64B]),
                                       "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(f, [acc, a, b])


def _hsum(builder, v):
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [V16I]), "llvm.vector.reduce.add.v16i32")
    return builder.call(f, [v])


def _byte(builder, word, k):
    """Byte k of an integer word, as i32."""
    w = builder.zext(word, ir.IntType(64)) if word.type.width < 64 else word
    return builder.trunc(builder.and_(builder.lshr(w, ir.Constant(w.type, 8 * k)), ir.Constant(w.type, 255)), I32)


def _halves(builder, lo, hi):
    """A 16-lane vector: lanes 0-7 = lo, 8-15 = hi (the lanes of a 64-value run's two 32s)."""
    mask = ir.Constant(ir.VectorType(ir.IntType(1), 16), [1] * 8 + [0] * 8)
    return builder.select(mask, _splat(builder, lo, V16I), _splat(builder, hi, V16I))


@intrinsic
def q4k_dot(typingctx, w, o, x, c, sa, sb):
    """sum_j scale_j * (q . x) over the 8 sub-blocks of the Q4_K block whose 128 nibble bytes
    start at w[o], with x[c:c+256] int8; scales j in the bytes of sa (0-3) and sb (4-7).
    Bytes 32i..32i+31 hold sub-block 2i in their low nibbles, 2i+1 in their high ones: one
    64-value run of x, so one vpdpbusd per byte run."""
    def codegen(context, builder, sig, args):
        aw, ao, ax, ac, a_sa, a_sb = args
        acc = ir.Constant(V16I, None)
        zero = ir.Constant(V16I, None)
        for i in range(4):
            q = _load(context, builder, sig.args[0], aw, builder.add(ao, ir.Constant(ao.type, 32 * i)), V32B)
            lo, hi = builder.and_(q, _const(V32B, 15)), builder.lshr(q, _const(V32B, 4))
            q64 = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 64), list(range(64))))
            xv = _load(context, builder, sig.args[2], ax, builder.add(ac, ir.Constant(ac.type, 64 * i)), V64B)
            word = a_sa if i < 2 else a_sb
            sc = _halves(builder, _byte(builder, word, 2 * (i % 2)), _byte(builder, word, 2 * (i % 2) + 1))
            acc = builder.add(acc, builder.mul(_dpbusd(builder, zero, q64, xv), sc))
        return _hsum(builder, acc)
    return types.int32(w, o, x, c, sa, sb), codegen


@intrinsic
def q6k_dot(typingctx, w, o, x, c):
    """sum_j scale_j * ((q + 32) . x) over the 16 sub-blocks of the Q6_K block at w[o], with
    x[c:c+256] int8 (the -32 goes through the sums of x, as in kquants). Values 128h + 64p +
    [0, 64) are one run: low 4 bits from ql[64h + 32k + l] (nibble p), high 2 from qh[32h + l]
    (bits 4p + 2k), k = 0 for the first 32 and 1 for the second; scale j = value // 16."""
    def codegen(context, builder, sig, args):
        aw, ao, ax, ac = args
        acc = ir.Constant(V16I, None)
        zero = ir.Constant(V16I, None)
        four = ir.Constant(ir.VectorType(I32, 16), [k // 4 for k in range(16)])
        for h in range(2):
            qh = _load(context, builder, sig.args[0], aw, builder.add(ao, ir.Constant(ao.type, 128 + 32 * h)), V32B)
            qa = _load(context, builder, sig.args[0], aw, builder.add(ao, ir.Constant(ao.type, 64 * h)), V32B)
            qb = _load(context, builder, sig.args[0], aw, builder.add(ao, ir.Constant(ao.type, 64 * h + 32)), V32B)
            for p in range(2):
                def six(ql, k):
                    low = builder.and_(builder.lshr(ql, _const(V32B, 4 * p)), _const(V32B, 15))
                    high = builder.shl(builder.and_(builder.lshr(qh, _const(V32B, 4 * p + 2 * k)), _const(V32B, 3)), _const(V32B, 4))
                    return builder.or_(low, high)
                q64 = builder.shuffle_vector(six(qa, 0), six(qb, 1), ir.Constant(ir.VectorType(I32, 64), list(range(64))))
                run = 128 * h + 64 * p
                xv = _load(context, builder, sig.args[2], ax, builder.add(ac, ir.Constant(ac.type, run)), V64B)
                s4 = _load(context, builder, sig.args[0], aw, builder.add(ao, ir.Constant(ao.type, 192 + run // 16)),
                           ir.VectorType(I8, 4))
                sc = builder.shuffle_vector(builder.sext(s4, ir.VectorType(I32, 4)), ir.Constant(ir.VectorType(I32, 4), None), four)
                acc = builder.add(acc, builder.mul(_dpbusd(builder, zero, q64, xv), sc))
        return _hsum(builder, acc)
    return types.int32(w, o, x, c), codegen
