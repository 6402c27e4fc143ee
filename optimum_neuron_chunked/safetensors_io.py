"""safetensors files read and written one tensor at a time.

The format (huggingface/safetensors, docs "format"): 8 bytes little-endian header length N,
N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
then the tensors' bytes, offsets relative to the end of the header.

Reading uses plain file reads into a fresh tensor, not a memory map: pages of a mapped
file count in the process's resident set for as long as the map lives, and the point of
streaming an export is a resident set near one tensor, not near the checkpoint. Writing
computes the whole header first (names, dtypes, shapes, offsets), then takes each tensor's
bytes at its offset, so no more than the tensor at hand is ever held.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors file, by name (metadata left out)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(
                f"{path}: tensor {name} has dtype {entry['dtype']}, which this reader does not know"
            )
        begin, end = entry["data_offsets"]
        infos[name] = TensorInfo(DTYPES[entry["dtype"]], tuple(entry["shape"]), start + begin, start + end)
    return infos


class CheckpointFiles:
    """The tensors of a checkpoint folder: one model.safetensors, or the shards an index names
    (model.safetensors.index.json, transformers' save_pretrained with max_shard_size)."""

    def __init__(self, folder: Path, single: str = SINGLE_NAME):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        if single != SINGLE_NAME:
            files = [single]
        elif index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.folder / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            raise FileNotFoundError(f"{self.folder} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
        self.tensors: dict[str, tuple[Path, TensorInfo]] = {}
        for file in files:
            for name, info in read_header(self.folder / file).items():
                self.tensors[name] = (self.folder / file, info)

    @classmethod
    def of_file(cls, path: Path) -> CheckpointFiles:
        """The tensors of one safetensors file."""
        return cls(Path(path).parent, Path(path).name)

    @staticmethod
    def present(folder: Path) -> bool:
        return (Path(folder) / INDEX_NAME).is_file() or (Path(folder) / SINGLE_NAME).is_file()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def nbytes(self) -> int:
        return sum(info.end - info.begin for _, info in self.tensors.values())

    def read(self, name: str) -> torch.Tensor:
        """A new tensor (its own memory) holding `name`'s values."""
        path, info = self.tensors[name]
        out = torch.empty(info.end - info.begin, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(info.begin)
            if info.end > info.begin and f.readinto(out.numpy()) != info.end - info.begin:
                raise OSError(f"{path}: truncated tensor {name}")
        return out.view(info.dtype).reshape(info.shape)


class SafetensorsWriter:
    """Writes a safetensors file whose header is fixed up front: tensors laid out by element
    size, largest first, then by name (`order`, as safetensors' own serializer sorts them, so
    every tensor starts aligned to its element size); `write` takes them one at a time, in any
    order (a quantized weight and its scale are computed together, and stored apart)."""

    def __init__(
        self,
        path: Path,
        entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.order = sorted(entries, key=lambda n: (-entries[n][0].itemsize, n))
        self.entries = entries
        header, offset, self._offsets = ({"__metadata__": metadata} if metadata else {}), 0, {}
        for name in self.order:
            dtype, shape = entries[name]
            size = dtype.itemsize * _numel(shape)
            header[name] = {
                "dtype": NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._offsets[name] = offset
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        self._data_start = 8 + len(blob)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._file.truncate(self._data_start + offset)
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        dtype, shape = self.entries.get(name, (None, None))
        if name in self._written or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            state = "written twice" if name in self._written else f"expected {dtype} {shape}"
            raise ValueError(f"{self.path.name}: got {name} {tensor.dtype} {tuple(tensor.shape)}, {state}")
        self._file.seek(self._data_start + self._offsets[name])
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._written.add(name)

    def close(self) -> None:
        self._file.close()
        if len(self._written) != len(self.order):
            raise ValueError(
                f"{self.path.name}: {len(self.order) - len(self._written)} tensors never written"
            )

    def abort(self) -> None:
        self._file.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
