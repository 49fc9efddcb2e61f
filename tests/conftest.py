import os

import runner.env  # noqa: F401  (thread-pool defaults, before numpy loads OpenBLAS)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import quant  # noqa: E402, F401
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# byte offsets of the f16 scale fields inside one block, per type
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(type_id, rows: int, n_blocks: int, rng) -> np.ndarray:
    """Random raw blocks with finite scales: every quant bit pattern occurs, no inf/nan."""
    block, size = GGML_QUANT_SIZES[T(type_id)]
    if type_id in (T.F32, T.F16, T.BF16):
        dt = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.float32}[T(type_id)]
        vals = rng.standard_normal((rows, n_blocks)).astype(dt)
        if type_id == T.BF16:
            vals = (vals.view(np.uint32) >> 16).astype(np.uint16)
        return vals.view(np.uint8).reshape(rows, n_blocks * size)
    raw = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)
    for off in HALF_FIELDS[T(type_id)]:
        raw[:, :, off:off + 2] = rng.uniform(-2, 2, (rows, n_blocks)).astype(np.float16).view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * size)


@pytest.fixture(scope="session", autouse=True)
def _threads():
    import numba
    numba.set_num_threads(min(2, os.cpu_count() or 1))
