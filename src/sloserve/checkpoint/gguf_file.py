"""A GGUF file's metadata and tensor table, read in one pass over its header (the format: ggml's docs/gguf.md).

NOTE: gguf-py's ``GGUFReader`` builds a numpy view for every string of the tokenizer's arrays: opening
SmolLM2-135M's file (49,152 tokens, 48,900 merges) took it 3.6-4.9 s on a 2-core VM, a Llama 3-sized vocabulary
(128,256 tokens, 280,147 merges) 14-20 s, before a single weight is read (`python benchmarks/gguf_open.py`). This
reads the same header with ``struct``, without the gguf package (the simulator's install reads a file's config
too), and gives each tensor as a view of the memory-mapped file shaped as ``GGUFReader`` shapes it, so that
``gguf.quants.dequantize`` takes it as it is. tests/engine/test_gguf_file.py checks both readers give the same
metadata and tensors."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)  # (version 1 wrote 32-bit lengths; llama.cpp stopped reading it in 2023, as gguf-py does)
DEFAULT_ALIGNMENT = 32
# GGUF's value types (gguf.GGUFValueType): the fixed-size ones as struct formats
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# ggml's tensor types (gguf.GGMLQuantizationType's values) that ``GGUFReader`` gives an element dtype: F32, F16,
# I8, I16, I32, I64, F64 (every other one: its bytes, a row of blocks at a time)
ELEMENT_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of the file. NOTE: its type and weights come from the gguf package (its types' block sizes), which
    only the engine's install has: the simulator reads a file's metadata and tensor names without it."""

    name: str
    type_id: int  # ggml's type: gguf.GGMLQuantizationType's value
    shape: tuple[int, ...]  # its weights', numpy's order (ggml's dimensions reversed)
    start: int  # where its bytes start in the file
    file: mmap.mmap = field(repr=False)

    @property
    def tensor_type(self):
        import gguf

        return gguf.GGMLQuantizationType(self.type_id)

    @property
    def data(self) -> np.ndarray:
        """A read-only view of the file: the weights (``shape``), or a quantized type's bytes (..., a row's blocks)
        as ``GGUFReader`` gives them. Raises ``ValueError`` where the file ends before the tensor does."""
        dtype, shape = ELEMENT_DTYPES.get(self.type_id), self.shape
        if dtype is None:
            import gguf

            dtype, shape = np.uint8, gguf.quant_shape_to_byte_shape(shape, self.tensor_type)
        count = int(np.prod(shape))
        if self.start + count * np.dtype(dtype).itemsize > len(self.file):
            raise ValueError(f"tensor {self.name!r} runs past the file's end ({len(self.file):,} bytes)")
        return np.frombuffer(self.file, dtype, count, self.start).reshape(shape)


@dataclass(frozen=True)
class GGUFFile:
    """What ``read_gguf_file`` read: the key-value metadata and the tensor table, in the file's order."""

    metadata: dict[str, Any]  # key -> int, float, bool, str or a list of them (arrays of arrays flattened)
    tensors: list[GGUFTensor]

    def check_tensors(self) -> None:
        """Raise ``ValueError`` if the file ends before a tensor does (needs the gguf package)."""
        for tensor in self.tensors:
            tensor.data.shape  # noqa: B018  (the view checks its extent)


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
        table.append((name, tuple(reversed(dims)), header.scalar("I"), header.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-header.offset // alignment) * alignment
    tensors, names = [], set()
    for name, shape, type_id, offset in table:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(GGUFTensor(name, type_id, shape, data_start + offset, header.buffer))
    return GGUFFile(metadata, tensors)
