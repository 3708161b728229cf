"""KV-capacity and memory planner for GLM-5.3-Flash on vLLM 0.30 (pure Python: no torch, no vLLM).

    from glmctl.plan import load_model_spec, gpu_node, ServingSetup, WeightFormats, plan_capacity

    model = load_model_spec("glm-5.3-flash")            # or a checkpoint dir / config.json
    node = gpu_node("8xL40")                             # or gpu_node(num_gpus=8, gpu_memory_gib=44.4)
    setup = ServingSetup(tensor_parallel_size=8, kv_cache_dtype="fp8", max_num_seqs=8,
                         weights=WeightFormats.for_checkpoint(model.checkpoint_quant, experts="exl3:4"))
    plan = plan_capacity(model, node, setup)             # -> CapacityPlan (pydantic)
    plan.fits, plan.kv_tokens, plan.sessions_that_fit, plan.short_by_bytes

Modules: `model` (ModelSpec), `node` (NodeSpec, GPU table), `serving_setup` (ServingSetup), `kv_cache`
(vLLM's exact block/page/capacity rules), `weights`, `reserve`, `capacity` (plan_capacity),
`field_report` (the field report's five KV pools), `plan_tables` (Rich tables for the CLI), and the
package `prediction` (`glmctl plan --predict`: one TP rank as a TP1 model, its step measured on
another GPU -> predicted 8x L40 cells).
"""

from glmctl.plan.capacity import CapacityPlan, plan_capacity, sessions_that_fit
from glmctl.plan.kv_cache import KvCacheLayout, kv_cache_layout, kv_capacity
from glmctl.plan.model import ModelSpec, load_model_spec
from glmctl.plan.node import GPU_MODELS, NodeConstants, NodeSpec, cpu_node, gpu_node
from glmctl.plan.serving_setup import (
    ServingSetup,
    Speculative,
    WeightFormat,
    WeightFormats,
    parse_speculative,
)

__all__ = [
    "GPU_MODELS",
    "CapacityPlan",
    "KvCacheLayout",
    "ModelSpec",
    "NodeConstants",
    "NodeSpec",
    "ServingSetup",
    "Speculative",
    "WeightFormat",
    "WeightFormats",
    "cpu_node",
    "gpu_node",
    "kv_cache_layout",
    "kv_capacity",
    "load_model_spec",
    "parse_speculative",
    "plan_capacity",
    "sessions_that_fit",
]
