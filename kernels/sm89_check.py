"""Cross-compile every shipped and every benchmarked kernel configuration for Ada (sm_89) and
report its resources.

``python -m glmctl.kernels.sm89_check`` prints one JSON line per configuration: kernel, config,
``shared`` (bytes of shared memory per block, which must stay <= 99 KB = 101376 B on sm_89),
``regs`` and ``spills`` (SASS local-memory instructions, from the cubin; None when Triton ships no
``cuobjdump``), PTX local loads, and whether the PTX uses Hopper-only ``wgmma``. Arguments are
specialised as Triton's JIT specialises the real calls (pointers 16-byte aligned, the strides
and sizes named in ``DIVISIBLE`` divisible by 16), which is what makes the gathers vectorise.
Works on a machine without a GPU (``triton.compile`` with ``GPUTarget("cuda", 89, 32)``); run it
in a process where ``TRITON_INTERPRET`` is unset. ``tests/unit/test_kernels_sm89.py`` runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

SM89_SHARED_LIMIT = 101376
# Integer arguments the real calls pass as multiples of 16 (TP8 shapes and vLLM's layouts: row
# strides of 512 / 656 / 1024 elements or bytes, 2176-wide index rows, page strides of 8448 B).
DIVISIBLE = {"q_stride_t", "q_stride_h", "row_stride", "num_rows", "idx_stride_t", "topk",
             "out_stride_t", "out_stride_s", "out_stride_h", "split_len", "page_stride",
             "bt_stride", "out_stride", "logits_stride",
             # the block-FP8 linears: bf16 activations' and fp8 weights' row strides, N and K
             # (TP8 slices of GLM-5.3-Flash's projections are multiples of 128)
             "x_stride_m", "w_stride_n", "size_n", "size_k",
             # KDA's recurrent-state slot stride (a KV-pool page: 8 heads x 128 x 128 and padding)
             "state_stride_slot",
             # the EXL3 decode path: expert strides of trellis / scale tensors, the bf16 row stride,
             # split strides of its fp32 scratch (all multiples of 16 at every TP slice)
             "gtr_stride", "utr_stride", "dtr_stride", "gsuh_stride", "usuh_stride", "gsvh_stride",
             "usvh_stride", "dsuh_stride", "svh_stride", "x_stride", "part_split_stride", "y_split_stride"}


def shipped_configs():
    """(name, jit function, {arg: type}, {constexpr: value}, options) for every shipped config."""
    import triton.language as tl

    from . import (
        indexer_logits_paged,
        indexer_logits_ragged,
        kpool_decode_write,
        kpool_topk,
        mla_cache_write,
        sparse_mla_decode,
        sparse_mla_prefill,
    )

    i64, i32, f32 = "i64", "i32", "fp32"
    mla_types = dict(
        q_ptr="*bf16", q_stride_t=i64, q_stride_h=i64, kv_ptr="*fp8e4nv", kv_f32_ptr="*fp32",
        kv_scale_ptr="*fp32", row_stride=i64, num_rows=i64, idx_ptr="*i32", idx_stride_t=i64, topk=i32,
        out_ptr="*fp32", out_stride_t=i64, out_stride_s=i64, out_stride_h=i64, lse_ptr="*fp32",
        lse_stride_t=i64, lse_stride_s=i64, num_heads=i32, sm_scale_log2=f32, split_len=i32,
    )
    from . import sparse_mla_configs, sparse_mla_heads_n

    # Prefill runs the tile-skipping loop, decode the branch-free one (see sparse_mla_prefill).
    configs = {(fmt, cfg, "prefill") for (fmt, _), cfg in
               sparse_mla_configs.PREFILL_CONFIGS.items()}
    configs |= {(fmt, cfg, "decode") for (fmt, _), cfg in
                (*sparse_mla_configs.DECODE_CONFIGS.items(),
                 *sparse_mla_configs.DECODE_WIDE_CONFIGS.items())}
    configs |= {(fmt, cfg, "decode") for fmt, cfgs in
                sparse_mla_configs.DECODE_CANDIDATES.items() for cfg in cfgs}
    for fmt, cfg, use in sorted(configs, key=lambda c: (c[0], c[2], c[1].name)):
        fp8 = fmt != "bf16"
        types = dict(mla_types, kv_ptr="*fp8e4nv" if fp8 else "*bf16")
        dot = tl.float16 if fp8 else tl.bfloat16
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        tag = f"{fmt} {cfg.name}{' prefill' if use == 'prefill' else ''}"
        if cfg.layout == sparse_mla_configs.LAYOUT_HEADS_N:
            yield (f"sparse_mla_heads_n[{tag}]", sparse_mla_heads_n._sparse_mla_heads_n_kernel,
                   types, dict(KV_MODE=sparse_mla_heads_n.KV_MODES[fmt], HP=8,
                               BLOCK_N=cfg.block_n, SCALE_OFFSET=512, DOT_DTYPE=dot,
                               RELOAD=cfg.reload), options)
            continue
        yield (f"sparse_mla[{tag}]", sparse_mla_prefill._sparse_mla_kernel, types,
               dict(KV_MODE=sparse_mla_prefill.KV_MODES[fmt], PARTIAL=True, BLOCK_H=cfg.block_h,
                    BLOCK_N=cfg.block_n, SCALE_OFFSET=512, DOT_DTYPE=dot,
                    SKIP_EMPTY=use == "prefill", PREFETCH=cfg.prefetch,
                    RELOAD=cfg.reload and not cfg.prefetch), options)
    yield ("sparse_mla_combine[16 splits]", sparse_mla_decode._combine_kernel,
           dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", out_stride_t=i64,
                out_stride_h=i64, lse_ptr="*fp32", lse_stride_t=i64, num_heads=i32,
                num_splits=i32),
           dict(BLOCK_S=sparse_mla_decode.MAX_SPLITS, DIM=512),
           dict(num_warps=4, num_stages=1))
    for fmt, mode in (("fp8_ds_mla", mla_cache_write.MODE_FP8_DS_MLA),
                      ("fp8", mla_cache_write.MODE_FP8)):
        yield (f"mla_cache_write[{fmt}]", mla_cache_write._mla_cache_write_kernel,
               dict(kv_c_ptr="*bf16", kv_c_stride=i64, slot_ptr="*i64", cache_u8_ptr="*u8",
                    cache_f32_ptr="*fp32", kv_scale_ptr="*fp32", block_size=i32,
                    block_stride=i64, row_stride=i64),
               dict(MODE=mode, TILES=4, TILE=128, SCALE_OFFSET=512, ROW_BYTES=656),
               dict(num_warps=2, num_stages=1))
    paged = indexer_logits_paged
    paged_types = dict(q_ptr="*fp8e4nv", w_ptr="*fp32", kv_ptr="*fp8e4nv", kv_f32_ptr="*fp32",
                       page_stride=i64, bt_ptr="*i32", bt_stride=i64, ctx_ptr="*i32",
                       out_ptr="*fp32", out_stride=i64, num_req=i32, num_programs=i32)
    paged_cfgs = {c.name: c for c in paged.PAGED_CANDIDATES + list(paged.PAGED_CONFIGS.values())}
    for cfg in paged_cfgs.values():
        for next_n in (1, 4):
            common = dict(N=next_n, N_PAD=next_n, H=32, PAGE_POOLS=64, BLOCK_N=cfg.block_n,
                          DOT_DTYPE=tl.float16, PREFETCH=cfg.prefetch)
            if cfg.kernel == paged.KERNEL_PAGE_GRID:
                fn, extra = paged._indexer_logits_page_grid_kernel, dict(TILES=cfg.tiles)
            else:
                fn, extra = paged._indexer_logits_paged_kernel, dict(BLOCK_B=256)
            yield (f"indexer_logits_paged[N{next_n} H32 {cfg.name}]", fn, paged_types,
                   dict(common, **extra), dict(num_warps=cfg.num_warps,
                                               num_stages=cfg.num_stages))
    for heads, (block_m, block_n, warps, stages) in sorted(
            indexer_logits_ragged.RAGGED_CONFIGS.items()):
        yield (f"indexer_logits_ragged[H{heads} m{block_m} n{block_n}]",
               indexer_logits_ragged._indexer_logits_ragged_kernel,
               dict(q_ptr="*fp8e4nv", w_ptr="*fp32", k_ptr="*fp8e4nv", k_scale_ptr="*fp32",
                    starts_ptr="*i32", ends_ptr="*i32", out_ptr="*fp32", out_stride=i64,
                    num_tokens=i32),
               dict(H=heads, BLOCK_M=block_m, BLOCK_N=block_n, DOT_DTYPE=tl.float16),
               dict(num_warps=warps, num_stages=stages))
    yield ("kpool_decode_update[kpool16 ring18]", kpool_decode_write._kpool_decode_update_kernel,
           dict(cache_u8_ptr="*u8", cache_f32_ptr="*fp32", page_stride=i64, page_pools=i64,
                tail_ptr="*bf16", tail_block_stride=i64, tail_half_stride=i64,
                tail_slot_ptr="*i64", k_ptr="*bf16", k_stride_b=i64, k_stride_t=i64,
                gate_ptr="*bf16", gate_stride_b=i64, gate_stride_t=i64, ape_ptr="*fp32",
                slot_ptr="*i64", pos_ptr="*i64", next_n=i32),
           dict(KPOOL=16, RING=18, D=128, N_PAD=4),
           dict(num_warps=kpool_decode_write.DECODE_UPDATE_WARPS, num_stages=1))
    block, warps = kpool_topk.TOPK_CONFIG
    topk_types = dict(logits_ptr="*fp32", logits_stride=i64, starts_ptr="*i32", seq_ptr="*i32",
                      cand_val_ptr="*fp32", cand_idx_ptr="*i32", out_ptr="*i32", out_stride=i64,
                      out_width=i32)
    for merge in (False, True):
        yield (f"kpool_topk[kpool16 select128 {'merge of 16 slices' if merge else 'one pass'}]",
               kpool_topk._kpool_topk_kernel, topk_types,
               dict(HAS_STARTS=not merge, MERGE=merge, CAND=16 * 128 if merge else 1,
                    DIRECT_MAX=kpool_topk.DIRECT_MAX_POOLS, KPOOL=16, SELECT=128, BLOCK=block,
                    TAIL=16),
               dict(num_warps=warps, num_stages=1))
    yield ("kpool_topk_slices[16 slices]", kpool_topk._kpool_topk_slices_kernel, topk_types,
           dict(HAS_STARTS=False, KPOOL=16, SELECT=128, SLICES=16,
                DIRECT_MAX=kpool_topk.DIRECT_MAX_POOLS, BLOCK=block),
           dict(num_warps=warps, num_stages=1))
    from . import kpool_topk_threshold

    for cfg in kpool_topk.TOPK_CANDIDATES:
        cap = kpool_topk_threshold.threshold_capacity(cfg, 128, 16)
        yield (f"kpool_topk_threshold[{cfg.name}]",
               kpool_topk_threshold._kpool_topk_threshold_kernel,
               dict(logits_ptr="*fp32", logits_stride=i64, starts_ptr="*i32", seq_ptr="*i32",
                    out_ptr="*i32", out_stride=i64, out_width=i32),
               dict(HAS_STARTS=False, KPOOL=16, SELECT=128, TAIL=16, R=cfg.rows, COLS=cfg.cols,
                    CAP=cap, T0_STEPS=cfg.t0_steps, BLOCK=1024),
               dict(num_warps=cfg.num_warps, num_stages=1))
    yield from _topk_packed_configs()
    yield from _mhc_configs()
    from . import fp8_block_linear

    yield from fp8_block_linear.sm89_configs()
    from . import kda_decode

    yield from kda_decode.sm89_configs()
    yield from _exl3_configs()
    from glmctl.collectives import direct_int8_kernels

    yield from direct_int8_kernels.sm89_configs()


def _exl3_configs():
    """The EXL3 MoE Triton path at GLM-5.3-Flash's TP8 shape (every DECODE_CONFIGS entry, the
    prefill slice's run table), the one-launch coop input preparation."""
    from . import exl3_coop_io

    yield from _exl3_moe_configs()
    yield ("exl3_coop_inputs", exl3_coop_io._coop_inputs_kernel,
           dict(x_ptr="*bf16", x_stride="i64", ids_ptr="*i32", w_ptr="*fp32", x16_ptr="*fp16",
                ids64_ptr="*i64", w16_ptr="*fp16", clamp_ptr="*i64"),
           dict(H=4096, TOPK=8, TOPK_PAD=8, BLOCK=1024, CHECK=True), dict(num_warps=4, num_stages=1))



def _exl3_moe_configs(hidden: int = 4096, intermediate: int = 256, top_k: int = 8, experts: int = 288,
                      target_tokens: tuple[int, ...] = (1, 32)):
    """Every launch of glmctl.kernels.exl3_moe_decode (decode batches) and exl3_moe_prefill (its
    kernels with longer runs) at GLM-5.3-Flash's TP8 shape."""
    import triton.language as tl

    from .exl3_moe_decode import DECODE_CONFIGS, ROWS, _down_kernel, _finish_kernel, _gate_up_kernel
    from .exl3_moe_rotate import rotate_configs

    i64, f32 = "i64", "fp32"
    runs = dict(order_ptr="*i32", run_e_ptr="*i32", run_s_ptr="*i32", run_n_ptr="*i32", meta_ptr="*i32")
    yield from rotate_configs(hidden, top_k, experts, target_tokens, ROWS)
    yield from rotate_configs(hidden, top_k, experts, (2048,), 64, combine=False)  # prefill: torch-sorted
    for split in sorted({c.split_k for c in DECODE_CONFIGS.values()}):
        yield (f"exl3_decode_finish[split{split}]", _finish_kernel,
               dict(part_ptr="*fp32", part_split_stride=i64, gsvh_ptr="*fp16", gsvh_stride=i64, usvh_ptr="*fp16",
                    usvh_stride=i64, dsuh_ptr="*fp16", dsuh_stride=i64, act_ptr="*fp16", dsum_ptr="*fp32",
                    act_limit=f32, **runs),
               dict(INTER=intermediate, ROWS=ROWS, SPLIT_K=split), dict(num_warps=4, num_stages=1))
    for cfg in DECODE_CONFIGS.values():
        options = dict(num_warps=cfg.warps, num_stages=cfg.stages)
        yield (f"exl3_decode_gate_up[{cfg.name}]", _gate_up_kernel,
               dict(xrot_ptr="*fp16", xsum_ptr="*fp32", gtr_ptr="*i32", gtr_stride=i64, utr_ptr="*i32",
                    utr_stride=i64, part_ptr="*fp32", part_split_stride=i64, **runs),
               dict(H=hidden, INTER=intermediate, ROWS=cfg.rows, SPLIT_K=cfg.split_k, BLOCK_K=cfg.block_k, FAST=True),
               options)
        yield (f"exl3_decode_down[{cfg.name}]", _down_kernel,
               dict(act_ptr="*fp16", dsum_ptr="*fp32", dtr_ptr="*i32", dtr_stride=i64, y_ptr="*fp32",
                    y_split_stride=i64, w_ptr="*fp32", svh_ptr="*fp16", svh_stride=i64, **runs),
               dict(H=hidden, INTER=intermediate, ROWS=cfg.rows, BLOCK_K=64, BLOCK_N2=cfg.block_n2,
                    DOWN_SPLIT=cfg.down_split, FAST=True, ROTATE=cfg.rotate_in_down, DOT_T=tl.bfloat16),
               options)

def _topk_packed_configs():
    """The packed top-k: every candidate on prefill rows (int32 lengths, row offsets), the
    shipped one also on decode rows (int64 positions and context lengths); the sparse-MLA
    backend's positions-to-rows kernel."""
    from . import kpool_topk_packed as packed
    from . import sparse_slots

    yield ("sparse_rows", sparse_slots._sparse_mla_rows_kernel,
           dict(idx_ptr="*i32", idx_stride="i64", req_ptr="*i32", bt_ptr="*i32",
                bt_stride="i64", bt_width="i32", out_ptr="*i32", out_stride="i64",
                width="i32", block_size="i32", rows_per_block="i32"),
           dict(BLOCK=sparse_slots.SPARSE_ROWS_BLOCK),
           dict(num_warps=sparse_slots.SPARSE_ROWS_WARPS, num_stages=1))

    types = dict(logits_ptr="*fp32", logits_stride="i64", starts_ptr="*i32", seq_ptr="*i32",
                 pos_ptr="*i32", ctx_ptr="*i32", out_ptr="*i32", out_stride="i64",
                 out_width="i32", valid_rows="i32")
    for cfg in packed.PACKED_CANDIDATES:
        for decode in (False, True) if cfg == packed.PACKED_CONFIG else (False,):
            cap = packed.packed_capacity(cfg, 128, 16)
            yield (f"kpool_topk_packed[{cfg.name}{' decode' if decode else ''}]",
                   packed._kpool_topk_packed_kernel,
                   dict(types, pos_ptr="*i64") if decode else types,
                   dict(HAS_STARTS=not decode, FROM_POSITIONS=decode, KPOOL=16, SELECT=128,
                        TAIL=16, R=cfg.rows, COLS=cfg.cols, CAP=cap, T0_STEPS=cfg.t0_steps,
                        BLOCK=1024),
                   dict(num_warps=cfg.num_warps, num_stages=1))


def _mhc_configs():
    """GLM-5.3-Flash's mHC blocks: 4 streams, hidden 4096 (the largest BLOCK_HF it needs)."""
    import triton

    from . import mhc_pre_post

    i32, f32 = "i32", "fp32"
    part_types = dict(res_ptr="*bf16", x_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32",
                      cur_ptr="*bf16", fn_ptr="*fp32", part_ptr="*fp32", sq_ptr="*fp32",
                      T=i32, H=i32)
    for cfg in mhc_pre_post.MIX_CONFIGS:
        for with_post, with_mix in ((True, True), (False, True), (True, False)):
            yield (f"mhc_mix_partials[{cfg.name} post={with_post} mix={with_mix}]",
                   mhc_pre_post._mix_partials_kernel, part_types,
                   dict(N=4, N3=24, MIX_PAD=32, BLOCK_T=cfg.block_t,
                        BLOCK_H=cfg.block_h, WITH_POST=with_post, WITH_MIX=with_mix),
                   dict(num_warps=cfg.num_warps, num_stages=1))
        yield (f"mhc_mix_finalize[{cfg.name} n4 H4096]", mhc_pre_post._mix_finalize_kernel,
               dict(part_ptr="*fp32", sq_ptr="*fp32", cur_ptr="*bf16", scale_ptr="*fp32",
                    base_ptr="*fp32", norm_w_ptr="*bf16", post_out_ptr="*fp32",
                    comb_out_ptr="*fp32", lin_out_ptr="*bf16", T=i32, H=i32, num_splits=i32,
                    rms_eps=f32, pre_eps=f32, sk_eps=f32, post_mult=f32, norm_eps=f32),
               dict(N=4, BLOCK_N=4, MIX_PAD=32, BLOCK_HF=4096,
                    BLOCK_S=triton.next_power_of_2(triton.cdiv(4096, cfg.block_h)),
                    SINKHORN_REPEAT=20, HAS_NORM=True),
               dict(num_warps=mhc_pre_post.finalize_warps(4096), num_stages=1))
    from . import mhc_decode

    types = dict(part_types, count_ptr="*i32", scale_ptr="*fp32", base_ptr="*fp32",
                 norm_w_ptr="*bf16", post_out_ptr="*fp32", comb_out_ptr="*fp32",
                 lin_out_ptr="*bf16", num_splits=i32, chunks_per_split=i32, rms_eps=f32,
                 pre_eps=f32, sk_eps=f32, post_mult=f32, norm_eps=f32)
    candidates = {cfg.name: cfg for _, cfg in mhc_decode.FUSED_CANDIDATES}
    for cfg in (*mhc_decode.FUSED_CONFIGS, *candidates.values()):
        splits, _ = cfg.plan(4096)
        fin_h = min(4096, cfg.fin_h)
        # the benchmark's candidates run the fused post+pre block only
        for with_post in (True, False) if cfg in mhc_decode.FUSED_CONFIGS else (True,):
            yield (f"mhc_block[{cfg.name} post={with_post}]", mhc_decode._mhc_block_kernel, types,
                   dict(N=4, N3=24, GP=8, CP=16, MIX_PAD=mhc_decode.mix_pad(4),
                        BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
                        BLOCK_S=triton.next_power_of_2(splits), FIN_H=fin_h,
                        FIN_CHUNKS=triton.cdiv(4096, fin_h), SINKHORN_REPEAT=20,
                        WITH_POST=with_post, HAS_NORM=True),
                   dict(num_warps=cfg.num_warps, num_stages=1))


def compile_for_sm89(fn, types: dict, constexprs: dict, options: dict, arch: int = 89) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {name: types.get(name, "constexpr") for name in names}
    missing = [n for n in names if signature[n] == "constexpr" and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr {missing}")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n in DIVISIBLE}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, "wgmma": "wgmma" in ptx,
            "local_loads": ptx.count("ld.local"), "num_warps": kernel.metadata.num_warps,
            **_cubin_resources(kernel.asm.get("cubin"))}


def _cubin_resources(cubin: bytes | None) -> dict:
    """Registers per thread and spill instructions (SASS LDL/STL) of a cubin, through the
    ``cuobjdump`` Triton ships; None where it is missing."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return {"regs": None, "spills": None}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    return {"regs": int(found.group(1)) if found else None,
            "spills": len(re.findall(r"\b(?:LDL|STL)\b", sass))}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to cross-compile", file=sys.stderr)
        return 2
    worst = 0
    for name, fn, types, constexprs, options in shipped_configs():
        info = compile_for_sm89(fn, types, constexprs, options)
        worst = max(worst, info["shared"])
        print(json.dumps({"kernel": name, **info}), flush=True)
    return 0 if worst <= SM89_SHARED_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
