"""Source tensors as torch tensors, for the EXL3 converter and its calibration forward.

Reads go through `safetensors_io.ShardReader` (one open file per shard, reused). A block-FP8
weight with a `weight_scale_inv` sibling is dequantised to fp32 on the way out, so callers never
see the source precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmctl.quantize.checkpoint import Checkpoint
from glmctl.quantize.safetensors_io import ShardHeader, ShardReader, TensorEntry

if TYPE_CHECKING:
    import torch

TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn",
                "I64": "int64", "I32": "int32", "I16": "int16", "U8": "uint8", "I8": "int8", "BOOL": "bool",
                "F64": "float64"}


class SourceReader:
    """Tensors of one checkpoint by name; use as a context manager (keeps shard files open)."""

    def __init__(self, ckpt: Checkpoint, fp8_block: int | None = None) -> None:
        self.ckpt = ckpt
        self.fp8_block = fp8_block
        self.index = ckpt.tensor_index()
        self._readers: dict[str, ShardReader] = {}

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc) -> None:
        for r in self._readers.values():
            r.__exit__(None, None, None)
        self._readers.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def raw(self, name: str) -> torch.Tensor:
        shard, entry = self.index[name]
        return read_entry(self._reader(shard), entry)

    def weight(self, name: str) -> torch.Tensor:
        """`name` (a `.weight`), dequantised to fp32 when it is block FP8, else as stored."""
        t = self.raw(name)
        scale_name = name + "_scale_inv"
        if scale_name in self.index and t.dtype.itemsize == 1:
            from glmctl.quantize.fp8 import dequantize_block_fp8

            if not self.fp8_block:
                raise ValueError(f"{name} is FP8 but the plan has no block size")
            return dequantize_block_fp8(t, self.raw(scale_name), self.fp8_block)
        return t

    def _reader(self, shard: ShardHeader) -> ShardReader:
        r = self._readers.get(shard.path.name)
        if r is None:
            r = ShardReader(shard).__enter__()
            self._readers[shard.path.name] = r
        return r


def read_entry(reader: ShardReader, entry: TensorEntry) -> torch.Tensor:
    import torch

    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    if entry.nbytes:
        reader.read_into(entry, 0, buf)
    dtype = getattr(torch, TORCH_DTYPES[entry.dtype])
    return buf.view(dtype).view(entry.shape)
