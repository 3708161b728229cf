"""`glmctl quantize verify`: is a block-FP8 checkpoint whole, self-consistent, and close to its source?

Structural checks (always): every index entry's shard exists and every header parses against its
file size (`open_checkpoint`); the index's total_size matches; `quantization_config` is the block
FP8 form vLLM 0.30 reads; every F8_E4M3 weight has an F32 `weight_scale_inv` of shape
[ceil(N/B), ceil(K/B)] with finite positive scales, and no NaN codes; every scale has its weight;
and the config matches the tensors the way vLLM's `is_layer_skipped` will read it: no FP8 module is
listed as unconverted, and every unconverted linear module that vLLM 0.30 builds with the FP8
method (dense MLP, shared experts, routed experts) is listed under the name vLLM looks up.

With a reference (the source checkpoint): every source tensor is present, tensors that were not
converted are byte-identical, and each converted weight is dequantised and compared with the
original: relative RMS error ||w - w'|| / ||w||, max |w - w'| and SNR = 10 log10(||w||^2 /
||w - w'||^2) in dB, computed over block-row stripes in float64.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.quantize.checkpoint import Checkpoint, open_checkpoint
from glmctl.quantize.fp8 import ErrorStats, dequantize_block_fp8, scale_shape
from glmctl.quantize.fp8_plan import FP8_DTYPES, is_linear_weight, module_of
from glmctl.quantize.glm5next import LayerKinds, experts_module, fused_group_of, vllm_fate
from glmctl.quantize.safetensors_io import (
    DTYPE_BYTES,
    FLOAT_DTYPES,
    CheckpointError,
    ShardReader,
    TensorEntry,
)

from glmctl.errors import ConfigError

DEFAULT_MIN_SNR_DB = 25.0  # e4m3 block-FP8 of Gaussian-like weights measures ~31 dB; see tests
_CHUNK = 4 * 2**20  # bytes per read: the checks stream, so memory stays flat whatever the tensor size
_TORCH = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass
class TensorError:
    name: str
    shape: list[int]
    rel_rms: float
    max_abs: float
    snr_db: float
    ok: bool


@dataclass
class VerifyResult:
    path: str
    reference: str | None
    min_snr_db: float
    shards: int = 0
    tensors: int = 0
    fp8_weights: int = 0
    block: int | None = None
    problems: list[str] = field(default_factory=list)
    identical: int = 0  # tensors byte-identical to the reference
    errors: list[TensorError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(e.ok for e in self.errors)

    @property
    def worst_snr_db(self) -> float | None:
        return min((e.snr_db for e in self.errors), default=None)

    @property
    def max_rel_rms(self) -> float | None:
        return max((e.rel_rms for e in self.errors), default=None)


Progress = Callable[[int, int], None]


def verify_fp8(path: Path, reference: Path | None = None, *, min_snr_db: float = DEFAULT_MIN_SNR_DB,
               on_progress: Progress | None = None) -> VerifyResult:
    """Every check in the module doc. A checkpoint too damaged to open (a missing shard, a bad
    header, an index that disagrees) is a failed result naming the damage, not an exception: a
    verifier reports on exactly the checkpoints that are broken. A bad --reference still raises."""
    ref = open_checkpoint(Path(reference), "--reference") if reference is not None else None
    try:
        ckpt = open_checkpoint(Path(path), "DST")
    except (CheckpointError, ConfigError) as exc:
        return VerifyResult(str(Path(path).absolute()), str(ref.path) if ref else None, min_snr_db,
                            problems=[exc.message])
    result = VerifyResult(str(ckpt.path), str(ref.path) if ref else None, min_snr_db,
                          shards=len(ckpt.shards), tensors=sum(len(s.tensors) for s in ckpt.shards))
    problems = result.problems
    entries = {e.name: (s, e) for s, e in ckpt.tensors()}
    block = _check_config(ckpt, problems)
    result.block = block
    if ckpt.index is not None:
        total = (ckpt.index.get("metadata") or {}).get("total_size")
        if total is not None and total != sum(s.data_bytes for s in ckpt.shards):
            problems.append(f"index metadata total_size {total} != {sum(s.data_bytes for s in ckpt.shards)} "
                            "bytes of tensors in the shards")
    fp8 = sorted(n for n, (_, e) in entries.items() if e.dtype in FP8_DTYPES and n.endswith(".weight"))
    result.fp8_weights = len(fp8)
    for name in sorted(entries):
        if name.endswith(".weight_scale_inv"):
            w = entries.get(name.removesuffix("_scale_inv"))
            if w is None or w[1].dtype not in FP8_DTYPES:
                problems.append(f"{name} has no FP8 weight beside it")
    if block:
        for name in fp8:
            _check_scale_entry(name, entries, block, problems)
    _check_skip_list(ckpt, set(fp8), problems)

    total = sum(e.nbytes for n, (_, e) in entries.items() if n in fp8 or n.endswith("_scale_inv"))
    if ref is not None:
        total += sum(s.data_bytes for s in ref.shards) + sum(s.data_bytes for s in ckpt.shards)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if on_progress:
            on_progress(done[0], total)

    if block:
        _check_values(ckpt, fp8, entries, problems, advance)
    if ref is not None and block:
        _compare(ckpt, ref, entries, block, result, advance)
    return result


def _check_config(ckpt: Checkpoint, problems: list[str]) -> int | None:
    q = ckpt.config.get("quantization_config")
    if not isinstance(q, dict):
        problems.append("config.json has no quantization_config: vLLM would load the FP8 tensors as BF16")
        return None
    if q.get("quant_method") != "fp8":
        problems.append(f"quantization_config.quant_method is {q.get('quant_method')!r}, not 'fp8'")
    if q.get("activation_scheme") != "dynamic":
        problems.append("quantization_config.activation_scheme must be 'dynamic' for block FP8 "
                        f"(vLLM's Fp8Config), got {q.get('activation_scheme')!r}")
    blocks = q.get("weight_block_size")
    if not (isinstance(blocks, list) and len(blocks) == 2 and all(isinstance(b, int) and b > 0 for b in blocks)):
        problems.append(f"quantization_config.weight_block_size must be [B, B], got {blocks!r}")
        return None
    if blocks[0] != blocks[1]:
        problems.append(f"weight_block_size {blocks} is not square; glmctl writes and checks square blocks")
        return None
    return blocks[0]


def _check_scale_entry(name: str, entries: dict, block: int, problems: list[str]) -> None:
    w = entries[name][1]
    s = entries.get(module_of(name) + ".weight_scale_inv")
    if len(w.shape) != 2:
        problems.append(f"{name} is FP8 but not a matrix {list(w.shape)}")
    elif s is None:
        problems.append(f"{name} is FP8 without a weight_scale_inv: it cannot be dequantised")
    elif s[1].dtype != "F32" or s[1].shape != scale_shape(w.shape, block):
        problems.append(f"{module_of(name)}.weight_scale_inv is {s[1].dtype} {list(s[1].shape)}, expected "
                        f"F32 {list(scale_shape(w.shape, block))} for a {list(w.shape)} weight in {block}-blocks")


def _skip_list(ckpt: Checkpoint) -> list[str]:
    q = ckpt.config.get("quantization_config") or {}
    return list(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])


def _check_skip_list(ckpt: Checkpoint, fp8: set[str], problems: list[str]) -> None:
    """Mirror vLLM 0.30's is_layer_skipped (exact match; experts by substring) for this model."""
    skip = set(_skip_list(ckpt))
    kinds = LayerKinds(ckpt.text_config())
    for name in sorted(fp8):
        if module_of(name) in skip:
            problems.append(f"{module_of(name)} is FP8 but listed in modules_to_not_convert")
    if not kinds.is_glm5next:
        return
    seen: set[str] = set()
    for _, e in ckpt.tensors():
        module = module_of(e.name)
        if not (is_linear_weight(e) or e.dtype in FP8_DTYPES) or vllm_fate(module, kinds) != "fp8":
            continue  # only modules vLLM 0.30 builds with the FP8 method need an explicit skip entry
        moe = experts_module(module, kinds)
        group = fused_group_of(module, kinds)
        if moe is not None:
            if e.name not in fp8 and not any(moe in s for s in skip if "experts" in s):
                _once(seen, moe, problems, f"{moe} has unquantised experts but is not in "
                      "modules_to_not_convert: vLLM 0.30 would build it with Fp8MoEMethod and fail to load")
        elif group is not None:
            states = {f"{m}.weight" in fp8 for m in group[2]}
            if len(states) > 1:
                _once(seen, group[1], problems, f"{group[1]} mixes FP8 and unquantised shards: vLLM cannot fuse them")
            elif states == {False} and group[1] not in skip:
                _once(seen, group[1], problems, f"{group[1]} is unquantised but not in modules_to_not_convert: "
                      "vLLM 0.30 would build it with the FP8 method and fail to load its weights")
        elif e.name not in fp8 and module not in skip:
            problems.append(f"{module} is unquantised but not in modules_to_not_convert: vLLM 0.30 "
                            "would build it with the FP8 method and fail to load its weights")


def _once(seen: set[str], key: str, problems: list[str], text: str) -> None:
    if key not in seen:
        seen.add(key)
        problems.append(text)


def _check_values(ckpt: Checkpoint, fp8: list[str], entries: dict, problems: list[str], advance) -> None:
    import torch

    for shard in ckpt.shards:
        names = [n for n in fp8 if entries[n][0] is shard]
        if not names:
            continue
        with ShardReader(shard) as reader:
            for name in names:
                e = shard.tensors[name]
                nan = 0
                for chunk in reader.chunks(e, _CHUNK):
                    b = torch.frombuffer(chunk, dtype=torch.uint8)
                    nan += int(torch.count_nonzero(b.bitwise_and_(0x7F) == 0x7F))  # e4m3fn NaN: S.1111.111
                    advance(chunk.nbytes)
                if nan:
                    problems.append(f"{name} holds {nan} NaN codes")
                sname = module_of(name) + ".weight_scale_inv"
                if sname in shard.tensors:
                    s = _read_tensor(reader, shard.tensors[sname])
                    advance(shard.tensors[sname].nbytes)
                    if not bool((torch.isfinite(s) & (s > 0)).all()):
                        problems.append(f"{sname} holds non-finite or non-positive scales")


def _read_tensor(reader: ShardReader, e: TensorEntry):
    import torch

    buf = torch.empty(e.nbytes, dtype=torch.uint8)
    reader.read_into(e, 0, buf)
    return buf.view(getattr(torch, _TORCH.get(e.dtype, "uint8"))).view(*e.shape) if e.nbytes else buf


def _compare(ckpt: Checkpoint, ref: Checkpoint, entries: dict, block: int, result: VerifyResult, advance) -> None:
    ref_entries = ref.tensor_index()
    for name in sorted(set(ref_entries) - set(entries)):
        result.problems.append(f"{name} is in the reference but missing here")
    for name in sorted(set(entries) - set(ref_entries)):
        if not (name.endswith(".weight_scale_inv") and name.removesuffix("_scale_inv") in ref_entries):
            result.problems.append(f"{name} is not in the reference and is not the scale of a converted weight")
    with contextlib.ExitStack() as stack:
        ref_readers: dict[str, ShardReader] = {}

        def ref_reader(header) -> ShardReader:
            if header.path.name not in ref_readers:
                ref_readers[header.path.name] = stack.enter_context(ShardReader(header))
            return ref_readers[header.path.name]

        for shard in ckpt.shards:
            with ShardReader(shard) as reader:
                for name, e in shard.tensors.items():
                    if name not in ref_entries:
                        advance(e.nbytes)
                        continue
                    rshard, r = ref_entries[name]
                    rreader = ref_reader(rshard)
                    if e.dtype in FP8_DTYPES and r.dtype in FLOAT_DTYPES:
                        result.errors.append(_dequant_error(reader, e, shard, rreader, r, block, result, advance))
                    elif _same_bytes(reader, e, rreader, r, advance):
                        result.identical += 1
                    else:
                        result.problems.append(f"{name} differs from the reference although it was not converted")


def _same_bytes(reader: ShardReader, e: TensorEntry, rreader: ShardReader, r: TensorEntry, advance) -> bool:
    if (e.dtype, e.shape) != (r.dtype, r.shape):
        advance(e.nbytes + r.nbytes)
        return False
    same = True
    for a, b in zip(reader.chunks(e, _CHUNK), rreader.chunks(r, _CHUNK), strict=True):
        same = same and bytes(a) == bytes(b)
        advance(2 * a.nbytes)
    return same


def _dequant_error(reader, e: TensorEntry, shard, rreader, r: TensorEntry, block: int,
                   result: VerifyResult, advance) -> TensorError:
    import torch

    stats = ErrorStats()
    sname = module_of(e.name) + ".weight_scale_inv"
    if e.shape != r.shape or sname not in shard.tensors:
        result.problems.append(f"{e.name}: shape {list(e.shape)} vs reference {list(r.shape)}, or no scale")
        advance(e.nbytes + r.nbytes)
        return TensorError(e.name, list(e.shape), math.inf, math.inf, -math.inf, False)
    scales = _read_tensor(reader, shard.tensors[sname])
    rows, cols = e.shape
    stripe = max(block, _CHUNK // max(cols * 4, 1) // block * block)
    dtype = getattr(torch, _TORCH[r.dtype])
    for r0 in range(0, rows, stripe):
        n = min(stripe, rows - r0)
        q = torch.empty(n * cols, dtype=torch.uint8)
        reader.read_into(e, r0 * cols, q)
        w = torch.empty(n * cols * DTYPE_BYTES[r.dtype], dtype=torch.uint8)
        rreader.read_into(r, r0 * cols * DTYPE_BYTES[r.dtype], w)
        approx = dequantize_block_fp8(q.view(torch.float8_e4m3fn).view(n, cols),
                                      scales[r0 // block: -(-(r0 + n) // block)], block)
        stats.add(w.view(dtype).view(n, cols), approx)
        advance(q.numel() + w.numel())
    return TensorError(e.name, list(e.shape), stats.rel_rms, stats.max_abs, stats.snr_db,
                       stats.snr_db >= result.min_snr_db)
