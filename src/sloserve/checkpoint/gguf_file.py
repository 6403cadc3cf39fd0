"""A GGUF file's metadata and tensor table, read in one pass over its header (the format: ggml's docs/gguf.md).

NOTE: gguf-py's ``GGUFReader`` builds a numpy view for every string of the tokenizer's arrays: opening
SmolLM2-135M's file (49,152 tokens, 48,900 merges) took it 5.4 s on a 2-core VM, a Llama 3 file (128,256 and
280,147) several times that, before a single weight is read. This reads the same header with ``struct`` and
keeps the tensors as views of the memory-mapped file, shaped as ``GGUFReader`` shapes them, so that
``gguf.quants.dequantize`` (still gguf-py's) takes them as they are. tests/engine/test_gguf_file.py checks
both readers give the same metadata and tensors."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)  # (version 1 wrote 32-bit lengths; llama.cpp stopped reading it in 2023, as gguf-py does)
DEFAULT_ALIGNMENT = 32
# GGUF's value types (gguf.GGUFValueType): the fixed-size ones as struct formats
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# the tensor types ``GGUFReader`` gives an element dtype (every other one: its bytes, a row of blocks at a time)
ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the file: (*dims reversed) elements, or (..., bytes of a row's blocks)


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # key -> int, float, bool, str or a list of them (arrays of arrays flattened)
    tensors: list[GGUFTensor]


class _Header:
    """A cursor over the file's bytes (an ``mmap``), little-endian."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length:,} bytes at byte {self.offset:,} runs past the file's end")
        text = self.buffer[self.offset : end].decode("utf-8")
        self.offset = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == STRING:
            return self.string()
        if value_type in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[value_type])
        if value_type != ARRAY:
            raise ValueError(f"unknown metadata value type {value_type} at byte {self.offset:,}")
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type in SCALAR_FORMATS:  # NOTE: numbers in one read, not one at a time
            fmt = SCALAR_FORMATS[item_type]
            items = np.frombuffer(self.buffer, np.dtype("<" + fmt), count, self.offset).tolist()
            self.offset += count * struct.calcsize(fmt)
            return items
        items = [self.value(item_type) for _ in range(count)]
        # (as GGUFReader's ``contents()``: an array of arrays is one flat list)
        return [x for item in items for x in item] if item_type == ARRAY else items


def read_gguf_file(path: str | Path) -> GGUFFile:
    """The metadata and tensors of the GGUF file at ``path``. Raises ``ValueError`` (naming what is wrong) on a
    file that is not GGUF, is cut off, or is of a version or byte order this does not read."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # (an empty file: ValueError)
    if data[:4] != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    header = _Header(data)
    header.offset = len(GGUF_MAGIC)
    try:
        return _read(header)
    except struct.error:
        raise ValueError(f"the header runs past the file's end ({len(data):,} bytes)") from None


def _read(header: _Header) -> GGUFFile:
    import gguf

    version = header.scalar("I")
    if version not in VERSIONS:
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file (this reads little-endian ones, as llama.cpp's converter writes)")
        raise ValueError(f"GGUF version {version} (this reads versions {' and '.join(map(str, VERSIONS))})")
    num_tensors, num_fields = header.scalar("Q"), header.scalar("Q")
    metadata = {}
    for _ in range(num_fields):
        key = header.string()
        if key in metadata:
            raise ValueError(f"metadata key {key!r} appears twice")
        metadata[key] = header.value(header.scalar("I"))
    table = []
    for _ in range(num_tensors):
        name = header.string()
        dims = [header.scalar("Q") for _ in range(header.scalar("I"))]
        table.append((name, dims, gguf.GGMLQuantizationType(header.scalar("I")), header.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data, data_start = header.buffer, -(-header.offset // alignment) * alignment
    tensors, names = [], set()
    for name, dims, tensor_type, offset in table:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        shape = tuple(reversed(dims))  # NOTE: ggml lists the fastest-varying dimension first
        dtype = ELEMENT_DTYPES.get(tensor_type.name)
        if dtype is None:
            dtype, shape = np.uint8, gguf.quant_shape_to_byte_shape(shape, tensor_type)
        count, start = int(np.prod(shape)), data_start + offset
        if start + count * np.dtype(dtype).itemsize > len(data):
            raise ValueError(f"tensor {name!r} runs past the file's end ({len(data):,} bytes)")
        tensors.append(GGUFTensor(name, tensor_type, np.frombuffer(data, dtype, count, start).reshape(shape)))
    return GGUFFile(metadata, tensors)
