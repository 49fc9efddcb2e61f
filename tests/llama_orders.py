"""llama.cpp's float steps for a quantized matmul on an AVX512 CPU, stated plainly in Python
(slow; for the tests). The integer block sums are exact in any order; what decides the bits
is how each kernel turns them into float32 and adds them up:

- Q4_0 (repacked q4_0_8x8, gemv and gemm): one chain, the block's whole dot times d_w * d_x.
- Q8_0, Q5_0 (ggml_vec_dot_*_q8_0 for one token, tinyBLAS for a batch): 8 lanes, lane l the
  integer dot of values 4l..4l+3 of each block, fma'd with d_w * d_x into lane l; the lanes
  summed in hsum_float_8's tree.
- Q4_K (repacked q4_K_8x8): two chains, scales (d_w * d_x times the scaled dot) and mins
  (dmin_w * d_x times the mins' dot), subtracted at the end; the gemv adds once per block
  (one token, and the last len % 4 of a batch), the gemm once per pair of sub-blocks.
- Q6_K (ggml_vec_dot_q6_K_q8_K for one token): 8 lanes over the eight 32-value runs of a
  block, less 32 * the scaled x-sums of sub-blocks 2l and 2l + 1, fma'd with d_x * d_w; the
  tiled kernel (batches of 8 or more): fma(I * d_w, d_x, y) with I the block's whole sum.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from quant.act import quantize_q8_0, quantize_q8_K

f32 = np.float32


def _fma(a, b, c):
    """float32 fma (the float64 product is exact; its double rounding is negligibly rare)."""
    return f32(np.float64(f32(a)) * np.float64(f32(b)) + np.float64(f32(c)))


def _f16(b: np.ndarray) -> f32:
    return f32(b[:2].view(np.float16)[0])


def _hsum8(x):
    r = [f32(x[4 + i] + x[i]) for i in range(4)]
    return f32(f32(r[0] + r[2]) + f32(r[1] + r[3]))


def _q4k_scales(s: np.ndarray):
    sc, m = [], []
    for j in range(8):
        if j < 4:
            sc.append(int(s[j]) & 63)
            m.append(int(s[j + 4]) & 63)
        else:
            sc.append((int(s[j + 4]) & 0xF) | ((int(s[j - 4]) >> 6) << 4))
            m.append((int(s[j + 4]) >> 4) | ((int(s[j]) >> 6) << 4))
    return sc, m


def _q6k_values(b: np.ndarray) -> np.ndarray:
    ql, qh = b[:128].astype(np.int64), b[128:192].astype(np.int64)
    q = np.zeros(256, np.int64)
    for n in range(2):
        for l in range(32):
            q[128 * n + l] = (ql[64 * n + l] & 15) | ((qh[32 * n + l] & 3) << 4)
            q[128 * n + l + 32] = (ql[64 * n + l + 32] & 15) | (((qh[32 * n + l] >> 2) & 3) << 4)
            q[128 * n + l + 64] = (ql[64 * n + l] >> 4) | (((qh[32 * n + l] >> 4) & 3) << 4)
            q[128 * n + l + 96] = (ql[64 * n + l + 32] >> 4) | (((qh[32 * n + l] >> 6) & 3) << 4)
    return q


def row(type_id: int, raw_row: np.ndarray, x: np.ndarray, n_batch: int, index: int) -> f32:
    """One output of a batch of n_batch tokens: weight row raw_row against token index's
    activations x (float32)."""
    n = x.shape[0]
    if type_id == T.Q4_0:
        xq, xd = np.zeros(n, np.int8), np.zeros(n // 32, f32)
        quantize_q8_0(x, xq, xd, np.zeros(n // 32, f32), np.zeros(n // 32, np.int32))
        acc = f32(0)
        for b in range(n // 32):
            blk = raw_row[b * 18:(b + 1) * 18]
            w = np.concatenate([blk[2:] & 15, blk[2:] >> 4]).astype(np.int64) - 8
            acc = _fma(f32(int((w * xq[32 * b:32 * b + 32]).sum())), f32(_f16(blk) * xd[b]), acc)
        return acc
    if type_id in (T.Q8_0, T.Q5_0):
        xq, xd = np.zeros(n, np.int8), np.zeros(n // 32, f32)
        quantize_q8_0(x, xq, xd, np.zeros(n // 32, f32), np.zeros(n // 32, np.int32))
        bs = 34 if type_id == T.Q8_0 else 22
        lanes = [f32(0)] * 8
        for b in range(n // 32):
            blk = raw_row[b * bs:(b + 1) * bs]
            if type_id == T.Q8_0:
                w = blk[2:].view(np.int8).astype(np.int64)
            else:
                qh = int(blk[2:6].view(np.uint32)[0])
                nib = np.concatenate([blk[6:] & 15, blk[6:] >> 4]).astype(np.int64)
                w = nib + 16 * np.array([(qh >> i) & 1 for i in range(32)]) - 16
            dd = f32(_f16(blk) * xd[b])
            xv = xq[32 * b:32 * b + 32].astype(np.int64)
            for l in range(8):
                lanes[l] = _fma(dd, f32(int((w[4 * l:4 * l + 4] * xv[4 * l:4 * l + 4]).sum())), lanes[l])
        return _hsum8(lanes)
    xq, xd, bsums = np.zeros(n, np.int8), np.zeros(n // 256, f32), np.zeros(n // 16, np.int32)
    quantize_q8_K(x, xq, xd, bsums)
    if type_id == T.Q4_K:
        gemm = index < n_batch - n_batch % 4
        acc, accm = f32(0), f32(0)
        for b in range(n // 256):
            blk = raw_row[b * 144:(b + 1) * 144]
            d, dmin = _f16(blk), _f16(blk[2:])
            sc, m = _q4k_scales(blk[4:16])
            qs = blk[16:].astype(np.int64)
            xv = xq[256 * b:256 * b + 256].astype(np.int64)
            parts = []
            for p in range(4):      # sub-blocks 2p (low nibbles) and 2p + 1 (high)
                lo, hi = qs[32 * p:32 * p + 32] & 15, qs[32 * p:32 * p + 32] >> 4
                i = sc[2 * p] * int((lo * xv[64 * p:64 * p + 32]).sum()) + sc[2 * p + 1] * int((hi * xv[64 * p + 32:64 * p + 64]).sum())
                mm = sum(m[j] * int(bsums[16 * b + 2 * j] + bsums[16 * b + 2 * j + 1]) for j in (2 * p, 2 * p + 1))
                parts.append((i, mm))
            if not gemm:
                parts = [(sum(i for i, _ in parts), sum(mm for _, mm in parts))]
            for i, mm in parts:
                acc = _fma(f32(i), f32(d * xd[b]), acc)
                accm = _fma(f32(mm), f32(dmin * xd[b]), accm)
        return f32(acc - accm)
    assert type_id == T.Q6_K
    lanes, acc = [f32(0)] * 8, f32(0)
    for b in range(n // 256):
        blk = raw_row[b * 210:(b + 1) * 210]
        q, sc, d = _q6k_values(blk), blk[192:208].view(np.int8).astype(np.int64), _f16(blk[208:])
        xv, bs = xq[256 * b:256 * b + 256].astype(np.int64), bsums[16 * b:16 * b + 16].astype(np.int64)
        if n_batch >= 8:        # tiled
            whole = int(sum(sc[j] * ((q[16 * j:16 * j + 16] - 32) * xv[16 * j:16 * j + 16]).sum() for j in range(16)))
            acc = _fma(f32(f32(whole) * d), xd[b], acc)
            continue
        for l in range(8):
            lane = sum(int(sc[(32 * g + 4 * l) // 16] * (q[32 * g + 4 * l:32 * g + 4 * l + 4] * xv[32 * g + 4 * l:32 * g + 4 * l + 4]).sum())
                       for g in range(8))
            lane -= 32 * int(bs[2 * l] * sc[2 * l] + bs[2 * l + 1] * sc[2 * l + 1])
            lanes[l] = _fma(f32(xd[b] * d), f32(lane), lanes[l])
    return acc if n_batch >= 8 else _hsum8(lanes)


def matmul(type_id: int, raw: np.ndarray, X: np.ndarray) -> np.ndarray:
    """llama.cpp's Y for the batch X (each row of Y as its kernel for len(X) tokens gives it)."""
    return np.array([[row(type_id, raw[r], X[t], len(X), t) for r in range(raw.shape[0])] for t in range(len(X))], f32)
