"""Read GGUF v2/v3 files by memory-mapping them.

The header and metadata are parsed here directly over the memory map (gguf.GGUFReader
builds a Python object per element of the tokenizer arrays and takes seconds on real
files); tensor data is never copied: ``raw()`` returns a read-only view of the blocks.
Every count and offset is checked against the file size before it is used, so a hostile
header fails with a GGUFError instead of a huge allocation or a long loop.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf_io.types import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
MAX_DIMS = 4   # GGML_MAX_DIMS

# metadata value type id -> (struct code, numpy dtype) for the fixed-size scalars
_SCALARS = {0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
            4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
            10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64)}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_WINDOW = 1 << 20
KEEP_STRINGS = 1024     # string arrays this long are offered for keeping (string_arrays)


class GGUFError(Exception):
    """A file that is not a valid GGUF; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]     # GGUF order: dims[0] is the contiguous axis
    type_id: int
    offset: int               # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (rows, ..., cols)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.type_id).name

    @property
    def n_elements(self) -> int:
        return prod(self.dims)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str):
        raise GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"truncated: {what} at byte {self.pos} needs {n} bytes but the file has {self.size}")

    def scalar(self, code: str, what: str):
        n = struct.calcsize("<" + code)
        self.need(n, what)
        v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            self.fail(f"unknown metadata value type {vtype} in {what}")
        if depth > 8:
            self.fail(f"arrays nested too deeply in {what}")
        etype, n = self.scalar("I", what), self.scalar("Q", what)
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            self.need(n * dt.itemsize, what)
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
            self.pos += n * dt.itemsize
            return arr
        # strings take at least 8 bytes each, nested arrays at least 12: bound n before looping
        self.need(n * (8 if etype == _STRING else 12), what)
        if etype == _STRING:
            return self.strings(n, what)
        return [self.value(etype, what, depth + 1) for _ in range(n)]

    def strings(self, n: int, what: str) -> list[str]:
        # The tokenizer's vocabulary: 150k-260k strings. Slicing bytes is several times
        # faster than slicing the memmap's memoryview, so walk 1 MiB windows copied out of it.
        unpack, out, pos = _U64.unpack_from, [], self.pos
        win, base = b"", pos
        for _ in range(n):
            if pos + 8 > base + len(win):
                self.pos = pos
                self.need(8, what)
                win, base = bytes(self.buf[pos:pos + _WINDOW]), pos
            (length,) = unpack(win, pos - base)
            pos += 8
            end = pos + length
            if end > base + len(win):
                self.pos = pos
                self.need(length, what)
                win, base = bytes(self.buf[pos:pos + max(_WINDOW, length)]), pos
            out.append(win[pos - base:end - base].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out


class GGUFFile:
    def __init__(self, path: str | Path, known: dict | None = None):
        """known: the large string arrays of this same file as an earlier open read them
        (string_arrays: key -> [start, end, strings]), taken instead of decoding them again
        (~0.1-0.2 s of a start for a BPE vocabulary); kept: the keys taken."""
        self.path = Path(path)
        self.string_arrays: dict[str, list] = {}
        self.kept: set[str] = set()
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except ValueError:   # numpy refuses to map an empty file
            raise GGUFError(f"{self.path}: empty file, not a GGUF model") from None
        self.file_size = len(self._mm)
        c = _Cursor(memoryview(self._mm), self.path)
        if self.file_size < 4 or bytes(self._mm[:4]) != MAGIC:
            c.fail("not a GGUF file (bad magic)")
        c.pos = 4
        self.version = c.scalar("I", "version")
        if self.version not in (2, 3):
            c.fail(f"unsupported GGUF version {self.version} (numbat reads versions 2 and 3)")
        n_tensors, n_kv = c.scalar("Q", "tensor count"), c.scalar("Q", "metadata count")
        # each KV takes >= 8+1+4 bytes and each tensor info >= 8+1+4+8+4+8: counts past that cannot fit
        if n_kv * 13 > self.file_size or n_tensors * 33 > self.file_size:
            c.fail(f"header claims {n_tensors} tensors and {n_kv} metadata keys, more than the file can hold")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string("metadata key")
            vtype, start = c.scalar("I", f"type of {key}"), c.pos
            hit = (known or {}).get(key)
            if vtype == _ARRAY and hit and hit[0] == start and start < hit[1] <= self.file_size:
                c.pos, self.metadata[key] = hit[1], hit[2]
                self.kept.add(key)
                continue
            v = self.metadata[key] = c.value(vtype, key)
            if vtype == _ARRAY and isinstance(v, list) and len(v) >= KEEP_STRINGS and isinstance(v[0], str):
                self.string_arrays[key] = [start, c.pos, v]
        infos = []
        for _ in range(n_tensors):
            name = c.string("tensor name")
            n_dims = c.scalar("I", f"dims of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                c.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            dims = tuple(c.scalar("Q", f"dims of {name}") for _ in range(n_dims))
            infos.append((name, dims, c.scalar("I", f"type of {name}"), c.scalar("Q", f"offset of {name}")))
        self.alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            c.fail(f"general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-c.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, rel in infos:
            self.tensors[name] = self._check_tensor(c, name, dims, type_id, rel)

    def _check_tensor(self, c: _Cursor, name, dims, type_id, rel) -> TensorInfo:
        if type_id not in GGML_QUANT_SIZES:
            c.fail(f"tensor {name} has unknown type id {type_id}")
        block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        if any(d == 0 for d in dims) or dims[0] % block:
            c.fail(f"tensor {name} has shape {list(dims)}, which does not fit "
                   f"{GGMLQuantizationType(type_id).name} blocks of {block}")
        nbytes = prod(dims) // block * tsize
        if rel % self.alignment:
            c.fail(f"tensor {name} data offset {rel} is not aligned to {self.alignment}")
        start = self.data_offset + rel
        if start + nbytes > self.file_size:
            c.fail(f"tensor {name} data ({nbytes} bytes at {start}) runs past the end of the file "
                   f"({self.file_size} bytes): the file is truncated or corrupt")
        return TensorInfo(name, dims, type_id, start, nbytes)

    # ---- tensor views (zero-copy, read-only) ----
    def raw(self, name: str) -> np.ndarray:
        """Blocks of a tensor as uint8 (n_rows, row_bytes): one row per output feature."""
        t = self.tensors[name]
        rows = prod(t.dims[1:])
        return self._mm[t.offset:t.offset + t.nbytes].reshape(rows, t.nbytes // rows)

    def release(self, name: str) -> None:
        """Drop this process's pages of a tensor that was copied elsewhere (quant.packed), so
        resident memory does not hold it twice; the page cache keeps the file."""
        t = self.tensors[name]
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if end > start:
            self._mm._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def array(self, name: str) -> np.ndarray:
        """A float tensor (F32/F16) as a typed view in numpy order."""
        t = self.tensors[name]
        dt = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}[t.type_id]
        return self._mm[t.offset:t.offset + t.nbytes].view(dt).reshape(t.shape)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "unknown")

    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())


def open_gguf(path: str | Path, known: dict | None = None) -> GGUFFile:
    return GGUFFile(path, known)
