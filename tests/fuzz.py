"""Fuzz the model loader: mutated tiny GGUF models through open, config, validation, load, a
tokenized prompt and one-token forwards, each outcome sorted into ok, refused (one of
numbat's own error types), foreign (any other exception), crash (the process died: a
segfault, a heap-corruption abort) or hang (no answer within the timeout).

    python -m tests.fuzz 20000                 # before a release; exit 1 on any crash/hang/foreign
    python -m tests.fuzz 2000 --boundscheck    # kernels recompiled with NUMBA_BOUNDSCHECK=1

Files are made from a fixed seed (file i from (seed, i)), so a count is reproducible and a
failure is kept with its index. Starting Python with numba and the kernels costs 1-2 s, so
one worker subprocess takes file after file over a pipe and is restarted only when it dies
or hangs; the file it was on is the culprit.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIRST_TIMEOUT = 900.0   # a fresh worker's first file may compile kernels (cold cache in CI)
TIMEOUT = 120.0         # later files: a hang, not a slow file (a new kernel type compiles in <60 s)

# one base per architecture, with the weight types the kernels specialise on
BASES = [
    ("llama", dict(extra="rope_dims")),
    ("qwen2", dict(weight_type="Q8_0")),
    ("qwen3", dict(weight_type="Q4_0", tied_output=True)),
    ("gemma3", dict(head_dim=32, n_layer=3)),
    ("llama", dict(weight_type="Q4_K", n_embd=256, n_ff=256, n_head=4, n_head_kv=4)),
    ("qwen2", dict(weight_type="Q6_K", n_embd=256, n_ff=256, tied_output=True)),
]


def write_bases(into: Path) -> list[Path]:
    from gguf import GGMLQuantizationType as T

    from gguf_io.testing import write_tiny_model
    from gguf_io.testing import _patch, header_fields
    out = []
    for i, (arch, kw) in enumerate(BASES):
        kw = dict(kw)
        wtype = T[kw.pop("weight_type", "F32")]
        if kw.pop("extra", None):
            kw["extra"] = lambda w: w.add_rope_dimension_count(16)
        # gguf-py cannot quantize to K types: write Q8_0 and relabel the matrices, whose
        # K-quant blocks are smaller, so they stay inside the file (their bits are random)
        k_type = wtype in (T.Q4_K, T.Q6_K)
        p = write_tiny_model(into / f"base{i}.gguf", arch, seed=i, weight_type=T.Q8_0 if k_type else wtype, **kw)
        if k_type:
            _, dims, types = header_fields(p)
            for name, f in types.items():
                if dims[name].end - dims[name].start == 16:
                    _patch(p, f.start, struct.pack("<I", wtype))
        out.append(p)
    return out


# ---------------------------------------------------------------- mutations

_INT_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
_FLOAT_CODES = {6: "f", 12: "d"}


def _interesting_int(rng, old: int, bits: int) -> int:
    pick = rng.integers(10)
    vals = [0, 1, 2, 3, old + 1, old - 1, old * 2, old // 2, (1 << bits) - 1, 1 << int(rng.integers(bits))]
    return int(vals[pick])


def _pack_int(code: str, v: int) -> bytes:
    size = struct.calcsize("<" + code)
    v &= (1 << (8 * size)) - 1          # wrap into the field, as a careless writer would
    if code.islower() and v >= 1 << (8 * size - 1):
        v -= 1 << (8 * size)
    return struct.pack("<" + code, v)


class Mutator:
    def __init__(self, base: Path):
        from gguf_io.reader import open_gguf
        from gguf_io.testing import header_fields
        self.data = base.read_bytes()
        self.kv, self.dims, self.types = header_fields(base)
        self.header_end = open_gguf(base).data_offset
        self.names = [k.encode() for k in self.kv] + [t.encode() for t in self.dims]

    def mutate(self, rng) -> bytes:
        b = bytearray(self.data)
        cut = len(b)
        for _ in range(int(rng.integers(1, 4))):
            op = int(rng.integers(8))
            if op <= 1:       # a metadata number: most of what the config reads
                key = list(self.kv)[int(rng.integers(len(self.kv)))]
                f = self.kv[key]
                if f.vtype in _INT_CODES:
                    code = _INT_CODES[f.vtype]
                    old = struct.unpack_from("<" + code, b, f.start)[0]
                    b[f.start:f.end] = _pack_int(code, _interesting_int(rng, old, 8 * (f.end - f.start)))
                elif f.vtype in _FLOAT_CODES:
                    v = [0.0, -1.0, float("nan"), float("inf"), 1e30, 1e-30][int(rng.integers(6))]
                    b[f.start:f.end] = struct.pack("<" + _FLOAT_CODES[f.vtype], v)
                else:         # strings and arrays: a byte inside the value
                    pos = int(rng.integers(f.start, f.end))
                    b[pos] = int(rng.integers(256))
            elif op <= 3:     # a tensor dimension
                name = list(self.dims)[int(rng.integers(len(self.dims)))]
                f = self.dims[name]
                n = (f.end - f.start) // 8
                dims = list(struct.unpack_from(f"<{n}Q", b, f.start))
                j = int(rng.integers(n))
                if n == 2 and rng.integers(3) == 0:
                    dims.reverse()
                else:
                    dims[j] = _interesting_int(rng, dims[j], 64) & ((1 << 64) - 1)
                b[f.start:f.end] = struct.pack(f"<{n}Q", *dims)
            elif op == 4:     # a tensor type
                f = self.types[list(self.types)[int(rng.integers(len(self.types)))]]
                b[f.start:f.end] = struct.pack("<I", int(rng.integers(40)))
            elif op == 5:     # a key or tensor name no longer found: a missing key or tensor
                name = self.names[int(rng.integers(len(self.names)))]
                pos = bytes(b).find(name)
                if pos >= 0:
                    b[pos + int(rng.integers(len(name)))] ^= 1 << int(rng.integers(7))
            elif op == 6:     # any header byte
                b[int(rng.integers(self.header_end))] = int(rng.integers(256))
            else:             # tensor data (NaN, inf) or a truncated file (cut last: the
                if rng.integers(4) == 0:     # other operations index the whole file)
                    cut = int(rng.integers(len(b)))
                elif len(b) > self.header_end:
                    for _ in range(int(rng.integers(1, 64))):
                        b[int(rng.integers(self.header_end, len(b)))] = int(rng.integers(256))
        return bytes(b[:cut])


# ---------------------------------------------------------------- the worker (one process, many files)

def check(path: str) -> str:
    """Everything `numbat prompt FILE "a" --raw -n 1` does with a file."""
    from runner.model import load
    m = load(path)
    ids = m.tokenizer.encode("a") or [0]
    cache = m.make_cache(32)
    logits = m.backend.forward(ids, cache)
    tok = int(np.argmax(logits[-1]))
    if not 0 <= tok < m.cfg.n_vocab:
        raise AssertionError(f"argmax {tok} outside the vocabulary")
    m.backend.forward([tok], cache)
    return "ok"


def worker() -> None:
    # results go on a private copy of stdout; anything else printing to fd 1 lands on stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import runner.env  # noqa: F401  (before numpy's OpenBLAS starts)
    from gguf_io.reader import GGUFError
    from quant import UnsupportedType
    from runner.chat_template import TemplateError
    from runner.generate import ContextError
    from runner.model import ModelError
    own = (GGUFError, ModelError, UnsupportedType, TemplateError, ContextError)
    if os.environ.get("NUMBAT_FUZZ_NO_VALIDATE"):   # --no-validate: what validation prevents
        import gguf_io.validate
        import runner.model
        gguf_io.validate.validate = runner.model.validate = lambda f, cfg: None
    out.write("ready\n")
    for line in sys.stdin:
        path = line.rstrip("\n")
        try:
            res = {"status": check(path)}
        except own as e:
            res = {"status": "refused", "type": type(e).__name__, "msg": str(e).splitlines()[0][:300] if str(e) else ""}
        except BaseException as e:   # noqa: BLE001  (MemoryError, numba errors...: all findings)
            import traceback
            res = {"status": "foreign", "type": type(e).__name__, "msg": str(e)[:300],
                   "where": traceback.format_exc().splitlines()[-3:]}
        out.write(json.dumps(res) + "\n")


class Worker:
    def __init__(self, env: dict, log: Path):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz", "--worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.fresh = True
        if self._line(FIRST_TIMEOUT) != "ready":
            raise RuntimeError(f"fuzz worker did not start (see {log})")

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        return self.proc.stdout.readline().decode().strip() or None

    def run(self, path: Path) -> dict:
        self.proc.stdin.write(f"{path}\n".encode())
        self.proc.stdin.flush()
        line = self._line(FIRST_TIMEOUT if self.fresh else TIMEOUT)
        self.fresh = False
        if line is None:
            if self.proc.poll() is None:
                self.stop()
                return {"status": "hang"}
            return {"status": "crash", "code": self.proc.wait()}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def run(n: int, seed: int = 0, boundscheck: bool = False, keep: Path | None = None,
        report=print, validate: bool = True) -> tuple[Counter, list[dict]]:
    """Fuzz n files; returns the counts by outcome (refusals also by message kind) and the
    failures (crash, hang, foreign) with the index that rebuilds their file."""
    work = Path(tempfile.mkdtemp(prefix="numbat-fuzz-"))
    env = {**os.environ, "NUMBAT_HOME": str(work / "home"), "PYTHONFAULTHANDLER": "1"}
    if boundscheck:
        # a kernel cache of its own: these kernels are other machine code
        env.update(NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(work / "numba-boundscheck"))
    if not validate:
        env["NUMBAT_FUZZ_NO_VALIDATE"] = "1"
    counts, failures = Counter(), []
    w = None
    try:
        bases = write_bases(work)
        mutators = [Mutator(b) for b in bases]
        w = Worker(env, work / "worker.log")
        for b in bases:   # the harness works: every unmutated base runs
            r = w.run(b)
            if r["status"] != "ok":
                raise RuntimeError(f"unmutated {b.name} did not run: {r}")
        t0 = time.perf_counter()
        for i in range(n):
            rng = np.random.default_rng([seed, i])
            k = int(rng.integers(len(mutators)))
            path = work / "case.gguf"
            path.write_bytes(mutators[k].mutate(rng))
            r = w.run(path)
            counts[r["status"]] += 1
            if r["status"] in ("crash", "hang", "foreign"):
                r.update(index=i, base=k)
                failures.append(r)
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, keep / f"fuzz-{seed}-{i}.gguf")
                report(f"file {i} (base {k}): {json.dumps(r)}")
                if r["status"] != "foreign":   # the worker died or was killed: a new one
                    w.stop()
                    w = Worker(env, work / "worker.log")
            if (i + 1) % 1000 == 0:
                report(f"{i + 1}/{n} files, {time.perf_counter() - t0:.0f} s: {dict(counts)}")
        counts["seconds"] = round(time.perf_counter() - t0)
    finally:
        if w is not None:
            w.stop()
        shutil.rmtree(work, ignore_errors=True)
    return counts, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, nargs="?", default=20000, help="files to try (default 20000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--boundscheck", action="store_true", help="kernels compiled with NUMBA_BOUNDSCHECK=1 (slow)")
    ap.add_argument("--keep", type=Path, help="copy crashing, hanging or foreign files here")
    ap.add_argument("--no-validate", action="store_true",
                    help="skip gguf_io.validate, to see what it prevents (expect crashes)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker()
        return 0
    counts, failures = run(a.n, a.seed, a.boundscheck, a.keep, validate=not a.no_validate)
    print(f"fuzz: {a.n} files, seed {a.seed}{', bounds-checked' if a.boundscheck else ''}: "
          f"{counts['ok']} ran, {counts['refused']} refused, {counts['foreign']} foreign exceptions, "
          f"{counts['crash']} crashes, {counts['hang']} hangs in {counts['seconds']} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
