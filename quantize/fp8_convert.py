"""`glmctl quantize fp8`: stream a safetensors checkpoint shard by shard into block-FP8.

Memory: a converted matrix is read in `READ_BYTES` pieces and quantised in stripes of whole block
rows (`STRIPE_BYTES` of source) on a thread pool, at most two reads in flight; every other tensor
is copied in `COPY_BYTES` pieces. Peak memory is therefore a few tens of MiB plus the fp32 copies
of the stripes being worked on, whatever the size of the checkpoint or of its largest tensor. Output shards keep the source shard names; each
converted `X.weight` becomes `X.weight` (F8_E4M3) followed by `X.weight_scale_inv` (F32).
Atomicity and resume: `glmctl.quantize.job` (one unit per shard).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.quantize.checkpoint import CONFIG, INDEX, Checkpoint, open_checkpoint
from glmctl.quantize.fp8 import quantize_block_fp8
from glmctl.quantize.fp8_plan import Fp8Plan, Fp8Settings, TensorPlan, module_of, plan_fp8
from glmctl.quantize.job import ConversionJob
from glmctl.quantize.safetensors_io import DTYPE_BYTES, ShardHeader, ShardReader, ShardWriter

from glmctl.errors import GlmctlError, UsageError

STRIPE_BYTES = 2**20  # source bytes quantised per task: fits in L2/L3 with its fp32 copy
READ_BYTES = 8 * 2**20  # source bytes per read
COPY_BYTES = 8 * 2**20
REPORT_FILE = "glmctl-quantize.json"
_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}

Progress = Callable[[int, int], None]  # (source bytes done, source bytes total)


class QuantizeError(GlmctlError):
    """A tensor could not be converted (e.g. it holds NaN). Exit code 1."""


class OutputVerificationFailed(GlmctlError):
    """What was written does not verify; it is not moved to DST. Exit code 1."""


@dataclass
class RoleRow:
    role: str
    fate: str  # glm5next.Fate: what stock vLLM 0.30 does with these tensors in FP8
    tensors: int
    bytes_in: int
    bytes_out: int
    plugin_fate: str = ""  # the same with glmctl's plugin


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
    rows: dict[tuple[str, str, str], RoleRow] = {}
    for t in plan.quantized:
        row = rows.setdefault((t.role, t.fate, t.plugin_fate),
                              RoleRow(t.role, t.fate, 0, 0, 0, t.plugin_fate))
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
    with _quantize_pool() as pool:
        for shard in todo:
            with job.unit(shard.path.name) as tmp:
                done = _convert_shard(shard, plan, tmp, settings.block, pool, done, total, on_progress)
            if on_shard_done:
                on_shard_done(shard.path.name)
    _write_metadata(job, ckpt, plan, result)
    _verify_output(job)
    job.finalize()
    result.shards_resumed = job.resumed_units
    result.notes += [f"{unit} had changed since it was written (size or SHA-256): converted again"
                     for unit in job.redone_units]
    result.seconds = time.perf_counter() - started
    return result


def _verify_output(job: ConversionJob) -> None:
    """`glmctl quantize verify`'s structural checks on the finished output, before it becomes DST:
    a checkpoint that fails them stays in the partial directory, never at DST."""
    from glmctl.quantize.verify import verify_fp8

    check = verify_fp8(job.work)
    if check.problems:
        raise OutputVerificationFailed(
            f"the converted checkpoint fails verification ({len(check.problems)} problem(s), first: "
            f"{check.problems[0]}); it was left in {job.work}, not moved to {job.dst}",
            hint="run glmctl quantize verify on it for the whole list; rerun with --force to convert again")


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise UsageError(f"DST {dst} overlaps SRC {src}", hint="write the converted checkpoint to a "
                         "directory outside the source (and not containing it)")


def _convert_shard(shard: ShardHeader, plan: Fp8Plan, path: Path, block: int, pool: ThreadPoolExecutor,
                   done: int, total: int, on_progress: Progress | None) -> int:
    metadata = {**shard.metadata, "format": "pt"}
    writer = ShardWriter(path, plan.layouts[shard.path.name], metadata)
    try:
        with ShardReader(shard) as reader:
            for entry in shard.tensors.values():
                t = plan.tensors[entry.name]
                if t.action == "quantize":
                    for n in _quantize_tensor(reader, entry, t, writer, block, pool):
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


def _quantize_tensor(reader: ShardReader, entry, t: TensorPlan, writer: ShardWriter, block: int,
                     pool: ThreadPoolExecutor):
    """Quantise `entry` in stripes of whole block rows on the pool, writing them in order.

    The main thread reads the next `READ_BYTES` while workers quantise the previous ones, so
    reading, quantising and writing overlap; at most two reads' worth of stripes are in flight.
    Yields the source bytes of each stripe once written.
    """
    import torch

    rows, cols = entry.shape
    row_bytes = cols * DTYPE_BYTES[entry.dtype]
    stripe_rows = max(block, STRIPE_BYTES // max(row_bytes, 1) // block * block)
    read_rows = max(stripe_rows, READ_BYTES // max(row_bytes, 1) // stripe_rows * stripe_rows)
    dtype = getattr(torch, _TORCH_DTYPES[entry.dtype])
    pending: deque = deque()
    scales = []

    def written(limit: int):
        while len(pending) > limit:
            future, r0, n = pending.popleft()
            try:
                q, s = future.result()
            except ValueError as exc:
                raise QuantizeError(f"{entry.name} rows {r0}..{r0 + n}: {exc}",
                                    hint="the source weights are damaged; exclude the module or fix "
                                         "the source") from exc
            writer.write(entry.name, q.view(torch.uint8).numpy())
            scales.append(s)
            yield n * row_bytes

    try:
        for r0 in range(0, rows, read_rows):
            n = min(read_rows, rows - r0)
            raw = torch.empty(n * row_bytes, dtype=torch.uint8)
            reader.read_into(entry, r0 * row_bytes, raw)
            matrix = raw.view(dtype).view(n, cols)
            for s0 in range(0, n, stripe_rows):
                k = min(stripe_rows, n - s0)
                pending.append((pool.submit(quantize_block_fp8, matrix[s0:s0 + k], block), r0 + s0, k))
            yield from written(2 * (read_rows // stripe_rows))
        yield from written(0)
    finally:
        for future, _, _ in pending:
            future.cancel()
    writer.write(f"{module_of(entry.name)}.weight_scale_inv", torch.cat(scales).numpy())


@contextlib.contextmanager
def _quantize_pool():
    """Worker threads for stripes; torch ops release the GIL, so each runs single-threaded.

    Cache-sized stripes on one thread each beat torch's own intra-op threads on big stripes (and
    degrade gracefully on a busy machine, where OpenMP barriers stall).
    """
    import torch

    workers = max(1, min(16, len(os.sched_getaffinity(0))))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="glmctl-fp8") as pool:
            yield pool
    finally:
        torch.set_num_threads(threads)


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
