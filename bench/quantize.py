#!/usr/bin/env python3
"""FP8 conversion throughput against plain reading of the same shards, in one run (target >= 0.5).

    python bench/quantize.py [--dir DIR] [--gib 1.0] [--runs 3] [--json] [--write]

Builds two synthetic safetensors checkpoints with GLM-5.3-Flash's real projection shapes (bf16):

- `attention`: KDA q/k/v/o [8192 x 4096] and MLA q_a/q_b/kv_a/kv_b/o + indexer wq_b/wk at their
  real sizes, every tensor selected by the default --modules: the worst case, all compute;
- `layer-mix`: the same attention plus routed-expert matrices [2048 x 4096], which the default
  selection copies byte for byte: closer to a real checkpoint, where experts are ~98% of the bytes.

For each: (1) read every tensor of every shard with glmctl's streaming reader after dropping the
files from the page cache (posix_fadvise DONTNEED after fsync), with and without its sequential
read-ahead hint, the faster counting: the disk's own speed for these files; (2) the same read with the files cached; (3) `glmctl quantize fp8` on the uncached source
(including writing and fsyncing the output). Throughput = source bytes / wall seconds; the ratio
(3)/(1) is the figure the target applies to; (3)/(2) says how much of a cached read the converter
keeps. Ceilings that explain the ratio, from the same run: (4) `copy`, a sequential read + write +
fsync of the same shards (what `cp` does); (5) `write-bound`, the disk's speed writing as many bytes
as the conversion outputs (from memory, fsync per GiB) divided by output/source bytes (the
converter writes ~0.5x of what it quantises and 1x of what it copies): no converter that writes
this output can beat it; (6) `CPU only`, quantising cached tensors on the converter's thread pool. Best of --runs. `--write` stores the result under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET = 0.5

ATTENTION = {  # one KDA layer and one MLA layer of GLM-5.3-Flash: [out, in]
    "kda.self_attn.q_proj": (8192, 4096), "kda.self_attn.k_proj": (8192, 4096),
    "kda.self_attn.v_proj": (8192, 4096), "kda.self_attn.o_proj": (4096, 8192),
    "mla.self_attn.q_a_proj": (1536, 4096), "mla.self_attn.q_b_proj": (16384, 1536),
    "mla.self_attn.kv_a_proj_with_mqa": (512, 4096), "mla.self_attn.kv_b_proj": (32768, 512),
    "mla.self_attn.o_proj": (4096, 16384), "mla.self_attn.indexer.wq_b": (4096, 1536),
    "mla.self_attn.indexer.wk": (128, 4096),
}
EXPERT = {"mlp.experts.{e}.gate_proj": (2048, 4096), "mlp.experts.{e}.up_proj": (2048, 4096),
          "mlp.experts.{e}.down_proj": (4096, 2048)}


def _layer_names(layer: int, kind: str) -> dict[str, tuple[int, int]]:
    return {f"model.layers.{layer}.{k.split('.', 1)[1]}.weight": v for k, v in ATTENTION.items()
            if k.startswith(kind + ".")}


def build(path: Path, gib: float, experts_share: float) -> int:
    """Write shards of ~1 GiB until `gib` GiB: attention layer pairs, plus experts for the mix."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    target, total, layer, shard, weight_map = int(gib * 2**30), 0, 0, 0, {}
    layer_types = []
    while total < target:
        tensors = {}
        for kind in ("kda", "mla"):
            layer_types.append("linear_attention" if kind == "kda" else "indexed_attention")
            tensors.update({n: s for n, s in _layer_names(layer, kind).items()})
            if experts_share:
                attn = sum(a * b * 2 for a, b in _layer_names(layer, kind).values())
                n_exp = round(attn * experts_share / (1 - experts_share) / (3 * 2048 * 4096 * 2))
                for e in range(n_exp):
                    tensors.update({f"model.layers.{layer}.{k.format(e=e)}.weight": v for k, v in EXPERT.items()})
            layer += 1
        data = {n: (torch.randn(s, generator=g) * s[1] ** -0.5).bfloat16() for n, s in tensors.items()}
        name = f"model-{shard + 1:05d}.safetensors"
        save_file(data, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, name))
        total += sum(t.numel() * 2 for t in data.values())
        shard += 1
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next", "num_hidden_layers": layer,
        "layer_types": layer_types}))
    return total


def _drop_cache(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(path: Path, hint: bool = True) -> float:
    """Every tensor's bytes through glmctl's reader, in 8 MiB pieces into one reused buffer;
    `hint=False` without its sequential-read hint (the baseline takes the faster of the two)."""
    import torch
    from glmctl.quantize import safetensors_io
    from glmctl.quantize.checkpoint import open_checkpoint
    from glmctl.quantize.safetensors_io import ShardReader

    if not hint:
        advise, safetensors_io._advise = safetensors_io._advise, lambda *a: None
        try:
            return read_all(path, hint=True)
        finally:
            safetensors_io._advise = advise

    buf = torch.empty(8 * 2**20, dtype=torch.uint8)
    t0 = time.perf_counter()
    n = 0
    for shard in open_checkpoint(path).shards:
        with ShardReader(shard) as reader:
            for entry in shard.tensors.values():
                for offset in range(0, entry.nbytes, buf.numel()):
                    k = min(buf.numel(), entry.nbytes - offset)
                    reader.read_into(entry, offset, buf[:k])
                    n += k
    return n / (time.perf_counter() - t0)


def copy_all(src: Path, dst: Path) -> float:
    """Read every shard and write its bytes to DST with fsync: what `cp` of the source achieves."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    t0 = time.perf_counter()
    n = 0
    buf = bytearray(8 * 2**20)
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fin, open(dst / f.name, "wb", buffering=0) as fout:
            while k := fin.readinto(buf):
                fout.write(memoryview(buf)[:k])
                n += k
            os.fsync(fout.fileno())
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return n / seconds


def write_only(dst: Path, nbytes: int) -> float:
    """Write `nbytes` from memory in 8 MiB pieces into files of <= 1 GiB, fsync each: disk write speed."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    buf = os.urandom(8 * 2**20)
    t0 = time.perf_counter()
    done, part = 0, 0
    while done < nbytes:
        with open(dst / f"part-{part}", "wb", buffering=0) as f:
            written = 0
            while written < 2**30 and done < nbytes:
                k = min(len(buf), nbytes - done)
                f.write(buf[:k])
                written += k
                done += k
            os.fsync(f.fileno())
        part += 1
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return nbytes / seconds


def quantize_in_memory(src: Path) -> float:
    """Quantise every tensor from cached memory on the converter's pool, no output: the CPU ceiling."""
    import torch
    from glmctl.quantize.checkpoint import open_checkpoint
    from glmctl.quantize.fp8 import quantize_block_fp8
    from glmctl.quantize.fp8_convert import STRIPE_BYTES, _quantize_pool
    from glmctl.quantize.safetensors_io import ShardReader

    matrices = []
    for shard in open_checkpoint(src).shards:
        with ShardReader(shard) as reader:
            for entry in list(shard.tensors.values())[:4]:
                raw = torch.empty(entry.nbytes, dtype=torch.uint8)
                reader.read_into(entry, 0, raw)
                matrices.append(raw.view(torch.bfloat16).view(*entry.shape))
    def rows(m):  # the converter's stripes: whole 128-row blocks, about STRIPE_BYTES of source
        return max(128, STRIPE_BYTES // (m.shape[1] * m.element_size()) // 128 * 128)

    stripes = [m[r:r + rows(m)] for m in matrices for r in range(0, m.shape[0], rows(m))]
    with _quantize_pool() as pool:
        t0 = time.perf_counter()
        for _ in pool.map(lambda x: quantize_block_fp8(x, 128), stripes):
            pass
        seconds = time.perf_counter() - t0
    return sum(m.numel() * 2 for m in matrices) / seconds


def convert(src: Path, dst: Path) -> tuple[float, float, float]:
    """(source MB/s, share of source bytes quantised, output bytes / source bytes)."""
    from glmctl.quantize.fp8_convert import convert_fp8
    from glmctl.quantize.fp8_plan import Fp8Settings

    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    result = convert_fp8(src, dst, Fp8Settings())
    seconds = time.perf_counter() - t0
    quantized = sum(r.bytes_in for r in result.roles) / result.bytes_in
    return result.bytes_in / seconds, quantized, result.bytes_out / result.bytes_in


def measure(work: Path, label: str, gib: float, experts_share: float, runs: int) -> dict:
    import torch

    src, dst = work / f"{label}-src", work / f"{label}-dst"
    total = build(src, gib, experts_share)
    torch.randn(8).to(torch.float8_e4m3fn)  # first-use costs out of the timed runs
    cold, warm, conv, copy, write, quantized, out_share = [], [], [], [], [], 0.0, 1.0
    for _ in range(runs):
        for hint in (True, False):
            _drop_cache(src)
            cold.append(read_all(src, hint))
        warm.append(read_all(src))
        _drop_cache(src)
        copy.append(copy_all(src, dst))
        _drop_cache(src)
        rate, quantized, out_share = convert(src, dst)
        conv.append(rate)
        write.append(write_only(dst, int(total * out_share)))
    compute = quantize_in_memory(src)
    shutil.rmtree(src)
    shutil.rmtree(dst, ignore_errors=True)
    row = {"checkpoint": label, "gib": round(total / 2**30, 2), "quantized_share": round(quantized, 3),
           "read_uncached_MBps": round(max(cold) / 1e6), "read_cached_MBps": round(max(warm) / 1e6),
           "output_share": round(out_share, 3), "write_output_MBps": round(max(write) / 1e6),
           "write_bound_convert_MBps": round(max(write) / out_share / 1e6),
           "copy_MBps": round(max(copy) / 1e6), "quantize_in_memory_MBps": round(compute / 1e6),
           "convert_MBps": round(max(conv) / 1e6)}
    row["ratio_vs_uncached_read"] = round(max(conv) / max(cold), 3)
    row["ratio_vs_cached_read"] = round(max(conv) / max(warm), 3)
    row["ratio_vs_copy"] = round(max(conv) / max(copy), 3)
    return row


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    import torch

    return {"cpu": model, "cpus_usable": len(os.sched_getaffinity(0)), "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(), "torch": torch.__version__}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None,
                    help="where to build the checkpoints: a real disk, not tmpfs (default: the temp dir)")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", action="store_true", help="store the result under bench/results/")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="glmctl-bench-fp8-", dir=args.dir))
    try:
        rows = [measure(work, "attention", args.gib, 0.0, args.runs),
                measure(work, "layer-mix", args.gib, 0.75, args.runs)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"bench": "quantize-fp8", "target_ratio_vs_uncached_read": TARGET, "machine": machine(),
           "runs": args.runs, "rows": rows,
           "method": "best of --runs; source bytes / wall seconds; reads with glmctl's ShardReader in "
                     "8 MiB pieces; uncached = fsync + posix_fadvise(DONTNEED) on every shard first; "
                     "conversion = convert_fp8 with the default --modules, writing and fsyncing output"}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"machine: {doc['machine']}")
        print(f"{'checkpoint':<11} {'GiB':>5} {'quantised':>9} {'read cold':>9} {'read warm':>9} {'copy':>6} "
              f"{'write-bound':>11} {'CPU only':>8} {'convert':>7} | {'/read cold':>10} {'/read warm':>10} {'/copy':>6}")
        for r in rows:
            print(f"{r['checkpoint']:<11} {r['gib']:>5} {r['quantized_share']:>9.0%} {r['read_uncached_MBps']:>9} "
                  f"{r['read_cached_MBps']:>9} {r['copy_MBps']:>6} {r['write_bound_convert_MBps']:>11} "
                  f"{r['quantize_in_memory_MBps']:>8} {r['convert_MBps']:>7} | {r['ratio_vs_uncached_read']:>10} "
                  f"{r['ratio_vs_cached_read']:>10} {r['ratio_vs_copy']:>6}")
        print(f"MB/s of source bytes; target: convert / read cold >= {TARGET}")
    if args.write:
        out = ROOT / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "quantize-fp8.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r["ratio_vs_uncached_read"] >= TARGET for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
