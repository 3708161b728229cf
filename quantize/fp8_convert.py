"""`glmctl quantize fp8`: stream a safetensors checkpoint shard by shard into block-FP8.

Memory: a converted matrix is read, quantised and written in stripes of whole block rows of at
most `STRIPE_BYTES` source bytes, and every other tensor is copied in `COPY_BYTES` pieces, so peak
memory is a few stripes (the fp32 working copy of a bf16 stripe is twice its size) whatever the
size of the checkpoint or of its largest tensor. Output shards keep the source shard names; each
converted `X.weight` becomes `X.weight` (F8_E4M3) followed by `X.weight_scale_inv` (F32).
Atomicity and resume: `glmctl.quantize.job` (one unit per shard).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.errors import GlmctlError, UsageError
from glmctl.quantize.checkpoint import CONFIG, INDEX, Checkpoint, open_checkpoint
from glmctl.quantize.fp8 import quantize_block_fp8
from glmctl.quantize.fp8_plan import Fp8Plan, Fp8Settings, TensorPlan, module_of, plan_fp8
from glmctl.quantize.glm5next import FATE_TEXT
from glmctl.quantize.job import ConversionJob
from glmctl.quantize.safetensors_io import DTYPE_BYTES, ShardHeader, ShardReader, ShardWriter

STRIPE_BYTES = 16 * 2**20
COPY_BYTES = 16 * 2**20
REPORT_FILE = "glmctl-quantize.json"
_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}

Progress = Callable[[int, int], None]  # (source bytes done, source bytes total)


class QuantizeError(GlmctlError):
    """A tensor could not be converted (e.g. it holds NaN). Exit code 1."""


@dataclass
class RoleRow:
    role: str
    fate: str
    tensors: int
    bytes_in: int
    bytes_out: int


@dataclass
class Fp8Result:
    src: str
    dst: str
    dry_run: bool
    settings: dict
    tensors_quantized: int
    tensors_kept_fp8: int
    tensors_copied: int
    bytes_in: int  # tensor bytes, source
    bytes_out: int  # tensor bytes, output
    roles: list[RoleRow]
    quantization_config: dict
    notes: list[str] = field(default_factory=list)
    shards: int = 0
    shards_resumed: int = 0
    seconds: float = 0.0

    @property
    def read_bytes_per_s(self) -> float:
        return self.bytes_in / self.seconds if self.seconds else 0.0


def _summarize(src: Path, dst: Path, plan: Fp8Plan, dry_run: bool) -> Fp8Result:
    actions = Counter(t.action for t in plan.tensors.values())
    rows: dict[tuple[str, str], RoleRow] = {}
    for t in plan.quantized:
        row = rows.setdefault((t.role, t.fate), RoleRow(t.role, FATE_TEXT.get(t.fate, t.fate), 0, 0, 0))
        row.tensors += 1
        row.bytes_in += t.bytes_in
        row.bytes_out += t.bytes_out
    return Fp8Result(
        src=str(src), dst=str(dst), dry_run=dry_run, settings=plan.settings.as_dict(),
        tensors_quantized=actions["quantize"], tensors_kept_fp8=actions["keep_fp8"],
        tensors_copied=actions["copy"], bytes_in=sum(t.bytes_in for t in plan.tensors.values()),
        bytes_out=plan.bytes_out(), roles=sorted(rows.values(), key=lambda r: r.role),
        quantization_config=plan.quantization_config, notes=list(plan.notes), shards=len(plan.layouts),
    )


def convert_fp8(src: Path, dst: Path, settings: Fp8Settings, *, force: bool = False,
                resume: bool = False, dry_run: bool = False, on_progress: Progress | None = None,
                on_shard_done: Callable[[str], None] | None = None) -> Fp8Result:
    """Convert SRC into DST (see the module docstring); returns what was done."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    _check_paths(src, dst)
    ckpt = open_checkpoint(src, "SRC")
    plan = plan_fp8(ckpt, settings)
    result = _summarize(src, dst, plan, dry_run)
    if dry_run:
        return result
    started = time.perf_counter()
    job = ConversionJob.start(dst, "fp8", settings.as_dict(), ckpt.fingerprint(), force=force, resume=resume)
    todo = [s for s in ckpt.shards if not job.is_finished(s.path.name)]
    job.check_space(plan.bytes_out({s.path.name for s in todo})
                    + sum((src / rel).stat().st_size for rel in ckpt.extra_files) + 2**20)
    total = sum(s.data_bytes for s in ckpt.shards)
    done = total - sum(s.data_bytes for s in todo)
    if on_progress:
        on_progress(done, total)
    for shard in todo:
        with job.unit(shard.path.name) as tmp:
            done = _convert_shard(shard, plan, tmp, settings.block, done, total, on_progress)
        if on_shard_done:
            on_shard_done(shard.path.name)
    _write_metadata(job, ckpt, plan, result)
    job.finalize()
    result.shards_resumed = job.resumed_units
    result.seconds = time.perf_counter() - started
    return result


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise UsageError(f"DST {dst} overlaps SRC {src}", hint="write the converted checkpoint to a "
                         "directory outside the source (and not containing it)")


def _convert_shard(shard: ShardHeader, plan: Fp8Plan, path: Path, block: int, done: int, total: int,
                   on_progress: Progress | None) -> int:
    metadata = {**shard.metadata, "format": "pt"}
    writer = ShardWriter(path, plan.layouts[shard.path.name], metadata)
    try:
        with ShardReader(shard) as reader:
            for entry in shard.tensors.values():
                t = plan.tensors[entry.name]
                if t.action == "quantize":
                    for n in _quantize_tensor(reader, entry, t, writer, block):
                        done += n
                        if on_progress:
                            on_progress(done, total)
                else:
                    for chunk in reader.chunks(entry, COPY_BYTES):
                        writer.write(entry.name, chunk)
                        done += chunk.nbytes
                        if on_progress:
                            on_progress(done, total)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return done


def _quantize_tensor(reader: ShardReader, entry, t: TensorPlan, writer: ShardWriter, block: int):
    """Quantise `entry` stripe by stripe (whole block rows), yielding source bytes consumed."""
    import torch

    rows, cols = entry.shape
    width = DTYPE_BYTES[entry.dtype]
    row_bytes = cols * width
    stripe_rows = max(block, STRIPE_BYTES // max(row_bytes, 1) // block * block)
    buf = torch.empty(min(stripe_rows, rows) * row_bytes, dtype=torch.uint8)
    dtype = getattr(torch, _TORCH_DTYPES[entry.dtype])
    scales = []
    for r0 in range(0, rows, stripe_rows):
        n = min(stripe_rows, rows - r0)
        raw = buf[: n * row_bytes]
        reader.read_into(entry, r0 * row_bytes, raw)
        try:
            q, s = quantize_block_fp8(raw.view(dtype).view(n, cols), block)
        except ValueError as exc:
            raise QuantizeError(f"{entry.name} rows {r0}..{r0 + n}: {exc}",
                                hint="the source weights are damaged; exclude the module or fix the source") from exc
        writer.write(entry.name, q.view(torch.uint8).numpy())
        scales.append(s)
        yield n * row_bytes
    writer.write(f"{module_of(entry.name)}.weight_scale_inv", torch.cat(scales).numpy())


def _write_metadata(job: ConversionJob, ckpt: Checkpoint, plan: Fp8Plan, result: Fp8Result) -> None:
    for rel in ckpt.extra_files:
        if rel.name != REPORT_FILE:
            job.copy_file(ckpt.path / rel, rel)
    if ckpt.index is not None:
        weight_map = {t.name: shard for shard, layout in plan.layouts.items() for t in layout}
        metadata = {**(ckpt.index.get("metadata") or {}), "total_size": plan.bytes_out()}
        if "total_parameters" in metadata:
            metadata["total_parameters"] = sum(
                t.nbytes // DTYPE_BYTES[t.dtype] for layout in plan.layouts.values() for t in layout)
        index = {**ckpt.index, "metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        job.write_file(INDEX, _json(index))
    from glmctl import __version__

    report = {"generator": f"glmctl {__version__} (glmctl quantize fp8)", "source": str(ckpt.path),
              "settings": plan.settings.as_dict(), "notes": plan.notes,
              "quantized": sorted(t.name for t in plan.quantized)}
    job.write_file(REPORT_FILE, _json(report))
    # config.json last: until it exists, the directory does not look like a checkpoint.
    config = {**ckpt.config, "quantization_config": plan.quantization_config}
    job.write_file(CONFIG, _json(config))


def _json(data: dict) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")
