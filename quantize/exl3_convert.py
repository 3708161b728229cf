"""`glmctl quantize exl3`: routed experts to EXL3 with exllamav3's quantizer; the rest copied.

Units of work (glmctl.quantize.job: each written to a temp name, fsynced, renamed, recorded):
  - every source shard that keeps tensors: copied byte for byte without the converted experts;
  - every converted MoE layer: `model-exl3-layer-LLL.safetensors` (glmctl.quantize.exl3_format),
    whose header metadata also carries that layer's per-tensor errors, so a resumed run's report
    is complete without any side file.
With `--calibration FILES` the layers are converted in model order while the calibration rows
stream through the model (glmctl.quantize.exl3_calibrate); the rows' state after each layer is
saved in the job directory, so `--resume` continues at the first unfinished layer. Without
calibration every layer is independent. config.json is written last, then the directory is
renamed into place: a DST that exists is complete.

Memory: exllamav3 quantizes 16 experts at a time on the GPU; the layer's finished EXL3 tensors
(about 3.6 GB for a GLM-5.3-Flash layer at 4 bits) stay in host memory until its unit is written,
because the unit's header carries the layer's error report.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.quantize.checkpoint import CONFIG, INDEX, Checkpoint, open_checkpoint
from glmctl.quantize.exl3_backend import LayerHessians, QuantizedLinear
from glmctl.quantize.exl3_format import EXLLAMAV3_VERSION, PROJECTIONS, REPORT_FILE
from glmctl.quantize.exl3_plan import Exl3Plan, Exl3Settings, LayerPlan, plan_exl3
from glmctl.quantize.exl3_source import SourceReader
from glmctl.quantize.job import ConversionJob
from glmctl.quantize.safetensors_io import ShardReader, ShardWriter

from glmctl.errors import UsageError

COPY_BYTES = 8 * 2**20
REPORT_META_KEY = "glmctl_exl3_report"
Progress = Callable[[int, int], None]  # (linears done, linears total)
# quantize_layer_experts' signature (exl3_backend); tests pass a CPU stand-in
LayerQuantizer = Callable[..., None]


@dataclass
class TensorError:
    name: str
    metric: str  # proxy_err | rmse
    error: float
    calibrated: bool
    seconds: float


@dataclass
class Exl3Result:
    src: str
    dst: str
    dry_run: bool
    settings: dict
    layers: list[str]  # converted experts modules
    linears: int  # expert projections converted
    expert_bytes_in: int
    expert_bytes_out: int
    bytes_out: int  # whole checkpoint
    quantization_config: dict
    notes: list[str] = field(default_factory=list)
    calibrated: int = 0
    uncalibrated: int = 0
    worst: list[TensorError] = field(default_factory=list)
    units_resumed: int = 0
    seconds: float = 0.0
    seconds_per_linear: float = 0.0
    report: str | None = None


def convert_exl3(src: Path, dst: Path, settings: Exl3Settings, *, force: bool = False, resume: bool = False,
                 dry_run: bool = False, on_progress: Progress | None = None,
                 quantizer: LayerQuantizer | None = None, device: str | None = None) -> Exl3Result:
    """Convert SRC into DST (see the module docstring); returns what was (or would be) done."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    _check_paths(src, dst)
    ckpt = open_checkpoint(src, "SRC")
    plan = plan_exl3(ckpt, settings)
    result = _summary(src, dst, plan, dry_run)
    if dry_run:
        return result
    if quantizer is None:
        from glmctl.quantize.exl3_backend import load_quantizer, quantize_layer_experts

        load_quantizer()
        _check_exllamav3_version()
        quantizer = quantize_layer_experts
    started = time.perf_counter()
    job = ConversionJob.start(dst, "exl3", settings.as_dict(), ckpt.fingerprint(), force=force, resume=resume)
    todo_shards = [s for s in plan.passthrough if not job.is_finished(s)]
    todo_layers = [layer for layer in plan.layers if not job.is_finished(layer.unit)]
    job.check_space(sum(t.nbytes for s in todo_shards for t in plan.passthrough[s])
                    + sum(layer.bytes_out(settings.bits) for layer in todo_layers)
                    + sum((src / rel).stat().st_size for rel in ckpt.extra_files) + 2**20)
    total = len(plan.layers) * plan.layers[0].num_experts * len(PROJECTIONS)
    progress = _Counter(total - sum(len(layer.sources) for layer in todo_layers), total, on_progress)
    shards = {s.path.name: s for s in ckpt.shards}
    for name in todo_shards:
        with job.unit(name) as tmp:
            _copy_shard(shards[name], plan, tmp)
    with SourceReader(ckpt, plan.fp8_block) as source:
        convert = _LayerConverter(plan, source, job, quantizer, progress)
        if settings.calibrated:
            _convert_calibrated(ckpt, plan, source, job, convert, device, resume)
        else:
            for layer in todo_layers:
                convert(layer, None)
    errors = _collect_errors(job, plan)
    _write_metadata(job, ckpt, plan, errors)
    job.finalize()
    _finish(result, errors, job.resumed_units, time.perf_counter() - started, dst)
    return result


class _Counter:
    def __init__(self, done: int, total: int, cb: Progress | None) -> None:
        self.done, self.total, self.cb = done, total, cb
        self.tick(0)

    def tick(self, n: int = 1) -> None:
        self.done += n
        if self.cb:
            self.cb(self.done, self.total)


class _LayerConverter:
    """Quantizes one layer's experts and writes its unit."""

    def __init__(self, plan: Exl3Plan, source: SourceReader, job: ConversionJob, quantizer: LayerQuantizer,
                 progress: _Counter) -> None:
        self.plan, self.source, self.job, self.quantizer, self.progress = plan, source, job, quantizer, progress

    def __call__(self, layer: LayerPlan, hessians: LayerHessians | None) -> None:
        bits = self.plan.settings.bits
        done: dict[tuple[int, str], QuantizedLinear] = {}

        def on_linear(e: int, proj: str, q: QuantizedLinear) -> None:
            done[(e, proj)] = q
            self.progress.tick()

        def weight(e: int, proj: str):
            return self.source.weight(layer.sources[(e, proj)].entry.name)

        self.quantizer(weight, layer.num_experts, layer.hidden, layer.intermediate, bits, hessians,
                       seed=self.plan.settings.seed + layer.layer, name=layer.linear, on_linear=on_linear)
        missing = [k for k in layer.sources if k not in done]
        if missing:
            raise RuntimeError(f"{layer.module}: the quantizer returned nothing for {missing[:3]}")
        report = {layer.linear(e, p): [q.metric, q.error, q.calibrated, round(q.seconds, 4)]
                  for (e, p), q in sorted(done.items())}
        layout = layer.layout(bits)
        with self.job.unit(layer.unit) as tmp:
            writer = ShardWriter(tmp, layout, {"format": "pt", REPORT_META_KEY: json.dumps(report)})
            try:
                for t in layout:
                    linear, suffix = t.name.rsplit(".", 1)
                    e, proj = _expert_proj(linear)
                    tensor = done[(e, proj)].tensors[suffix]
                    if tuple(tensor.shape) != t.shape:
                        raise RuntimeError(f"{t.name}: quantizer gave {list(tensor.shape)}, format says {list(t.shape)}")
                    writer.write(t.name, tensor.contiguous().view(-1).view(_u8()).numpy())
                writer.close()
            except BaseException:
                writer.abort()
                raise


def _convert_calibrated(ckpt: Checkpoint, plan: Exl3Plan, source: SourceReader, job: ConversionJob,
                        convert: _LayerConverter, device: str | None, resume: bool) -> None:
    import torch
    from glmctl.quantize.exl3_calibrate import (
        STATE_FILE,
        CalibrationState,
        LayerStreamer,
        MoECapture,
        calibration_rows,
    )

    s = plan.settings
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    streamer = LayerStreamer(source, ckpt.text_config(), device, dtype)
    units = {layer.layer: layer for layer in plan.layers}
    todo_main = [L for L, u in units.items() if L < streamer.num_layers and not job.is_finished(u.unit)]
    state_path = job.work / STATE_FILE
    if todo_main:
        state = CalibrationState.load(state_path) if resume else None
        if state is None or state.next_layer > min(todo_main):
            rows = calibration_rows([Path(p) for p in s.calibration], ckpt.path / "tokenizer.json",
                                    s.calibration_tokens, s.calibration_row)
            state = CalibrationState(0, streamer.embed(rows), None)
        for index in range(state.next_layer, max(todo_main) + 1):
            module = streamer.build(index)
            unit = units.get(index)
            capture = MoECapture(module) if unit is not None and index in todo_main else None
            state = streamer.run(module, state)
            hessians = capture.close() if capture else None
            del module
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            if unit is not None and hessians is not None:
                convert(unit, hessians)
            del hessians
            state.save(state_path)
    # The MTP layer lives outside transformers' decoder stack: calibration-free, as exllamav3 does
    for layer in plan.layers:
        if layer.layer >= streamer.num_layers and not job.is_finished(layer.unit):
            convert(layer, None)
    state_path.unlink(missing_ok=True)


def _copy_shard(shard, plan: Exl3Plan, path: Path) -> None:
    layout = plan.passthrough[shard.path.name]
    writer = ShardWriter(path, layout, {**shard.metadata, "format": "pt"})
    try:
        with ShardReader(shard) as reader:
            for t in layout:
                for chunk in reader.chunks(shard.tensors[t.name], COPY_BYTES):
                    writer.write(t.name, chunk)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _collect_errors(job: ConversionJob, plan: Exl3Plan) -> list[TensorError]:
    from glmctl.quantize.safetensors_io import read_header

    out = []
    for layer in plan.layers:
        meta = read_header(job.work / layer.unit).metadata.get(REPORT_META_KEY, "{}")
        for name, (metric, error, calibrated, seconds) in json.loads(meta).items():
            out.append(TensorError(name, metric, error, calibrated, seconds))
    return out


def _write_metadata(job: ConversionJob, ckpt: Checkpoint, plan: Exl3Plan, errors: list[TensorError]) -> None:
    for rel in ckpt.extra_files:
        if rel.name != REPORT_FILE:
            job.copy_file(ckpt.path / rel, rel)
    weight_map = plan.weight_map()
    metadata = {**((ckpt.index or {}).get("metadata") or {}), "total_size": plan.bytes_out()}
    if "total_parameters" in metadata:
        metadata.pop("total_parameters")  # an EXL3 trellis is not a count of parameters
    job.write_file(INDEX, _json({**(ckpt.index or {}), "metadata": metadata, "weight_map": weight_map}))
    from glmctl import __version__

    report = {"generator": f"glmctl {__version__} (glmctl quantize exl3)", "exllamav3": EXLLAMAV3_VERSION,
              "source": str(ckpt.path), "settings": plan.settings.as_dict(), "notes": plan.notes,
              "metrics": {"proxy_err": "tr(E H E^T) / tr(W H W^T) over the calibration inputs (calibrated)",
                          "rmse": "RMS weight error in exllamav3's regularised domain (calibration-free)"},
              "tensors": [vars(e) for e in errors]}
    job.write_file(REPORT_FILE, _json(report))
    # config.json last: until it exists, the directory does not look like a checkpoint.
    config = {**ckpt.config, "quantization_config": plan.quantization_config}
    job.write_file(CONFIG, _json(config))


def _summary(src: Path, dst: Path, plan: Exl3Plan, dry_run: bool) -> Exl3Result:
    bits = plan.settings.bits
    return Exl3Result(
        src=str(src), dst=str(dst), dry_run=dry_run, settings=plan.settings.as_dict(),
        layers=[layer.module for layer in plan.layers],
        linears=sum(len(layer.sources) for layer in plan.layers),
        expert_bytes_in=sum(layer.bytes_in() for layer in plan.layers),
        expert_bytes_out=sum(layer.bytes_out(bits) for layer in plan.layers),
        bytes_out=plan.bytes_out(), quantization_config=plan.quantization_config, notes=list(plan.notes))


def _finish(result: Exl3Result, errors: list[TensorError], resumed: int, seconds: float, dst: Path) -> None:
    result.calibrated = sum(e.calibrated for e in errors)
    result.uncalibrated = len(errors) - result.calibrated
    result.worst = sorted(errors, key=lambda e: -e.error)[:10]
    result.units_resumed = resumed
    result.seconds = seconds
    result.seconds_per_linear = sum(e.seconds for e in errors) / max(len(errors), 1)
    result.report = str(dst / REPORT_FILE)
    if result.uncalibrated and result.calibrated:
        result.notes.append(f"{result.uncalibrated} tensors were quantized calibration-free (the MTP layer, "
                            "which transformers does not run); see the report")


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise UsageError(f"DST {dst} overlaps SRC {src}", hint="write the converted checkpoint to a "
                         "directory outside the source (and not containing it)")


def _check_exllamav3_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("exllamav3")
    except PackageNotFoundError:
        return  # imported from a source tree; the shape checks still guard the format
    if found != EXLLAMAV3_VERSION:
        raise UsageError(f"exllamav3 {found} is installed; the glmctl-exl3/1 format is defined by "
                         f"exllamav3 {EXLLAMAV3_VERSION}", hint=f"pip install exllamav3=={EXLLAMAV3_VERSION}")


def _expert_proj(linear: str) -> tuple[int, str]:
    head, proj = linear.rsplit(".", 1)
    return int(head.rsplit(".", 1)[1]), proj


def _u8():
    import torch

    return torch.uint8


def _json(data: dict) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")

