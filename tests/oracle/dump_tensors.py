"""Dev tool: evaluate tokens in llama.cpp and save its named intermediate f32 tensors
(attn_norm-0, Qcur-0, kq-0, ffn_out-0, ...) to an .npz, to find where numbat departs from it.

    python tests/oracle/dump_tensors.py MODEL.gguf 1,2,3 out.npz
"""
import ctypes
import sys

import llama_cpp
import numpy as np


class Tensor(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def dump(model_path: str, ids: list[int], n_ctx: int = 512) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}

    def cb(t, ask, _):
        if ask:
            return True
        t = ctypes.cast(t, ctypes.POINTER(Tensor)).contents
        ne = list(t.ne)
        if t.type == 0 and t.data and t.nb[0] == 4:   # f32, rows contiguous
            n = int(np.prod(ne))
            strides = tuple(int(s) for s in reversed(list(t.nb)))
            buf = (ctypes.c_char * (int(t.nb[3]) * ne[3])).from_address(t.data)
            arr = np.ndarray(tuple(reversed(ne)), np.float32, buffer=buf, strides=strides)
            out[t.name.decode()] = np.array(arr)
        return True

    cbf = llama_cpp.ggml_backend_sched_eval_callback(cb)
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False)
    # the callback must be set on a context created with it: rebuild the context
    params = llm.context_params
    params.cb_eval = cbf
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    arr = (llama_cpp.llama_token * len(ids))(*ids)   # kept alive until decode returns
    batch = llama_cpp.llama_batch_get_one(arr, len(ids))
    assert llama_cpp.llama_decode(ctx, batch) == 0
    return out


if __name__ == "__main__":
    res = dump(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
    np.savez(sys.argv[3], **res)
    print(len(res), "tensors:", ", ".join(list(res)[:40]))
