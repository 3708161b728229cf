"""`glmctl plan`: KV capacity and memory per GPU for a model, node and serving setup."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import kv_cache_dtypes
from glmctl._cli.options import JsonOpt, ModelOpt, examples

_FMT = "bf16, fp8 or exl3:BITS"
_NODE = "Node"
_SETUP = "Serving setup"
_WEIGHTS = "Weight formats (default: as the checkpoint stores them)"


def _fmt_opt(flag: str, what: str, exl3: bool = False):
    kinds = _FMT if exl3 else "bf16 or fp8"
    return typer.Option(flag, help=f"{what}: {kinds}.", rich_help_panel=_WEIGHTS)


def plan(
    model: ModelOpt = "glm-5.3-flash",
    gpus: Annotated[
        str | None, typer.Option("--gpus", help="GPUs as COUNTxMODEL, e.g. 8xL40. Models: L40, L40S, RTX4090, L4, "
                                 "A10, A6000, A100-40GB, A100-80GB, H100.", rich_help_panel=_NODE)
    ] = None,
    num_gpus: Annotated[int | None, typer.Option("--num-gpus", min=1, help="GPU count (overrides --gpus).",
                                                 rich_help_panel=_NODE)] = None,
    gpu_memory_gib: Annotated[
        float | None, typer.Option("--gpu-memory-gib", help="CUDA-visible memory per GPU in GiB (overrides --gpus).",
                                   rich_help_panel=_NODE)
    ] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Plan for vLLM-CPU on this machine (KV space from "
                                      "--kv-cache-gib, $VLLM_CPU_KVCACHE_SPACE, else 1 GiB).",
                                      rich_help_panel=_NODE)] = False,
    kv_cache_gib: Annotated[
        float | None, typer.Option("--kv-cache-gib", help="Fixed KV space per device in GiB (vLLM's "
                                   "--kv-cache-memory-bytes); skips the utilization budget.", rich_help_panel=_NODE)
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", min=1, help="Nodes like this one behind vllm-router (glmctl fleet): "
                                 "sessions per node and in all, KV tokens per node, what one node's loss leaves.",
                                 rich_help_panel=_NODE)
    ] = None,
    tp: Annotated[int | None, typer.Option("--tp", min=1, help="Tensor-parallel size (default: all GPUs; 1 on CPU).",
                                           rich_help_panel=_SETUP)] = None,
    experts: Annotated[str | None, _fmt_opt("--experts", "routed experts", exl3=True)] = None,
    dense: Annotated[str | None, _fmt_opt("--dense", "shared experts and dense MLPs")] = None,
    kda: Annotated[str | None, _fmt_opt("--kda", "KDA (linear-attention) projections")] = None,
    mla: Annotated[str | None, _fmt_opt("--mla", "MLA and indexer projections")] = None,
    embeddings: Annotated[str | None, _fmt_opt("--embeddings", "embedding and LM head")] = None,
    kv_cache_dtype: Annotated[
        str, typer.Option("--kv-cache-dtype", autocompletion=kv_cache_dtypes, help="auto (bf16), bf16, fp8 (512 B/token/layer) or fp8_ds_mla "
                          "(vLLM's 656-byte DeepSeek record).", rich_help_panel=_SETUP)
    ] = "auto",
    speculative: Annotated[
        str, typer.Option("--speculative", help="none, mtp:N (the model's MTP layer) or dflash2:N (needs --drafter).",
                          rich_help_panel=_SETUP)
    ] = "none",
    drafter: Annotated[
        Path | None, typer.Option("--drafter", help="The DFlash2 drafter's checkpoint directory or config.json.",
                                  rich_help_panel=_SETUP)
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", min=1, help="Context per request in tokens (default 262,144, capped at "
                                 "the model's limit).", rich_help_panel=_SETUP)
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option("--max-num-seqs", min=1, help="Slots: concurrent requests (vLLM default 256 on GPU).",
                                 rich_help_panel=_SETUP)
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option("--max-num-batched-tokens", min=1, help="Tokens per step (vLLM's default for the GPU).",
                                 rich_help_panel=_SETUP)
    ] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", max=1.0, help="Fraction of GPU memory vLLM may use.",
                            rich_help_panel=_SETUP)
    ] = 0.92,
    cudagraph_capture_sizes: Annotated[
        str | None, typer.Option("--cudagraph-capture-sizes", help="Comma-separated batch sizes to capture.",
                                 rich_help_panel=_SETUP)
    ] = None,
    max_cudagraph_capture_size: Annotated[
        int | None, typer.Option("--max-cudagraph-capture-size", min=1, help="Capture vLLM's default sizes up to this.",
                                 rich_help_panel=_SETUP)
    ] = None,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="No CUDA graphs.",
                                                rich_help_panel=_SETUP)] = False,
    prefix_caching: Annotated[
        bool | None, typer.Option("--prefix-caching/--no-prefix-caching",
                                  help="vLLM's prefix caching (default: on for CUDA, off on CPU).",
                                  rich_help_panel=_SETUP)
    ] = None,
    block_size: Annotated[int | None, typer.Option("--block-size", min=1, help="vLLM --block-size (it may raise it).",
                                                   rich_help_panel=_SETUP)] = None,
    reproduce_report: Annotated[
        bool, typer.Option("--reproduce-report", help="Predict the field report's five KV pools on 8x L40 and "
                           "print the residuals (ignores the other options).")
    ] = False,
    predict: Annotated[
        Path | None, typer.Option("--predict", metavar="MEASURED.json", help="Predict 8x L40 decode and prefill "
                                  "from a rank step measured on another GPU, beside the report's cells (ignores "
                                  "the other options).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Plan KV capacity and per-GPU memory: weights by group, reserves, KV pool, tokens and sessions.

    Page sizes, block size, block count and KV tokens follow vLLM 0.30's own rules exactly; weights
    follow the module shapes; reserves are vLLM's rules plus stated estimates and node constants.
    With --nodes N: the same node N times behind vllm-router (glmctl fleet), each session on one node; the fleet's sessions and KV tokens, and what the loss of one node leaves.
    Exit code 1 when the setup does not fit (the plan is still printed), 2 for bad options.
    """
    from glmctl._cli.output import Output
    from glmctl.plan import plan_tables

    out = Output.from_flags(json_)
    if nodes is not None and (reproduce_report or predict is not None):
        from glmctl.errors import UsageError

        raise UsageError("--nodes plans a fleet of the node the other options describe; it does not combine "
                         "with --reproduce-report or --predict")
    if reproduce_report:
        from glmctl.plan.field_report import reproduce_report as reproduce

        result = reproduce()
        out.result(result, render=lambda console: plan_tables.render_report(result, console))
        return
    if predict is not None:
        from glmctl.plan.prediction.node_prediction import load_measured_run, predict_node

        prediction = predict_node(load_measured_run(predict))
        out.result(prediction, render=lambda console: plan_tables.render_prediction(prediction, console))
        return

    from glmctl.plan import cpu_node, gpu_node, load_model_spec, plan_capacity
    from glmctl.plan.serving_setup import (
        ServingSetup,
        WeightFormats,
        parse_capture_sizes,
        parse_speculative,
    )

    _check_fractions(gpu_memory_utilization=gpu_memory_utilization, gpu_memory_gib=gpu_memory_gib,
                     kv_cache_gib=kv_cache_gib)
    spec = load_model_spec(model)
    _check_model_limits(spec, max_model_len)
    node = cpu_node(kv_cache_gib) if cpu else gpu_node(gpus, num_gpus, gpu_memory_gib, kv_cache_gib)
    setup = ServingSetup(
        tensor_parallel_size=tp or (1 if cpu else node.num_devices),
        weights=WeightFormats.for_checkpoint(spec.checkpoint_quant, spec.fp8_attention, experts=experts,
                                             dense=dense, kda=kda, mla=mla, embeddings=embeddings),
        kv_cache_dtype=kv_cache_dtype,
        speculative=parse_speculative(speculative, str(drafter) if drafter else None),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        cudagraph_capture_sizes=parse_capture_sizes(cudagraph_capture_sizes),
        max_cudagraph_capture_size=max_cudagraph_capture_size,
        enable_prefix_caching=prefix_caching,
        block_size=block_size,
    )
    result = plan_capacity(spec, node, setup)
    if nodes is not None:
        from glmctl.plan.fleet_capacity import plan_fleet

        fleet = plan_fleet(result, nodes)
        out.result(fleet, render=lambda console: plan_tables.render_fleet(fleet, console))
    else:
        out.result(result, render=lambda console: plan_tables.render_plan(result, console))
    if not result.fits:
        out.warn(result.reason or "does not fit")
        raise typer.Exit(1)


def _check_fractions(**values: float | None) -> None:
    """Typer's ranges are closed and let NaN through: these must be finite and above 0."""
    import math

    from glmctl.errors import UsageError

    for name, value in values.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value} must be a number above 0"
                             + (" and at most 1" if name == "gpu_memory_utilization" else ""),
                             hint="e.g. --gpu-memory-utilization 0.92" if name == "gpu_memory_utilization" else None)


def _check_model_limits(spec, max_model_len: int | None) -> None:
    from glmctl.errors import UsageError

    if max_model_len is not None and max_model_len > spec.max_position_embeddings:
        raise UsageError(f"--max-model-len {max_model_len:,} is longer than {spec.name} supports "
                         f"(max_position_embeddings {spec.max_position_embeddings:,})",
                         hint=f"use --max-model-len {spec.max_position_embeddings:,} or less "
                              "(serve's preflight refuses it too)")


plan.epilog = examples(
    "glmctl plan --gpus 8xL40",
    "glmctl plan --gpus 8xL40 --kv-cache-dtype fp8 --speculative mtp:3 --kda fp8 --experts exl3:4 --max-num-seqs 8",
    "glmctl plan --model out/tiny-glm --cpu --block-size 1024 --json",
    "glmctl plan --gpus 8xL40 --kv-cache-dtype fp8 --speculative mtp:3 --experts exl3:4 --max-num-seqs 8 --nodes 4",
    "glmctl plan --reproduce-report",
    "glmctl plan --predict bench/results/rank-sim-h200.json",
)
