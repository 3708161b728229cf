"""Variant sweeps behind ``bench/kernels.py --sweep``: every named candidate configuration of the
sparse-MLA decode (``sparse_mla_configs.DECODE_CANDIDATES``, several split counts), the paged
indexer logits (``PAGED_CANDIDATES``) and the top-k (``TOPK_CANDIDATES`` + the radix kernels) at
the TP8 decode shapes, each timed as a CUDA-graph replay.

The sweep is a list of jobs in a fixed order; ``--shard i/n`` runs every n-th job once without
timing, so n processes started first compile the variants in parallel into Triton's on-disk
cache and the timing process finds them there. A compiling process holds one unfilled latent
cache at a time (at most 2 GiB, the bf16 one): 16 of them share one GPU.
"""

from __future__ import annotations

import functools
import json
from functools import partial

import kernels_common as kc
import torch
from glmctl.kernels import indexer_logits_paged as paged
from glmctl.kernels import kpool_topk as topk
from glmctl.kernels.sparse_mla_configs import DECODE_CANDIDATES
from glmctl.kernels.sparse_mla_decode import (
    plan_sparse_mla_decode,
    sparse_mla_decode,
    sparse_mla_decode_workspace,
)

DECODE_ROWS = 32  # 8 sessions x 4 tokens (MTP) at 240k: the case the targets name
DECODE_SPLITS = (None, 4, 8, 16)  # None: the planner's count
INDEXER_CASES = ((8, 1), (32, 1), (8, 4))
TOPK_ROWS = (8, 32)


@functools.cache
def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


_COMPILE_ONLY = [False]  # set by warm(): caches are left unfilled


@functools.cache
def _cache(fmt: str):
    return kc.latent_cache(fmt, 8 * kc.CONTEXTS["240k"], fill=not _COMPILE_ONLY[0])


@functools.cache
def _decode_case(rows: int):
    """8 sessions (the cache's) x rows / 8 query rows each."""
    return kc.decode_inputs(8, rows // 8, kc.CONTEXTS["240k"])


@functools.cache
def _indexer_case(requests: int, next_n: int):
    return kc.indexer_inputs(requests, next_n, kc.CONTEXTS["240k"])


@functools.cache
def _topk_case(rows: int):
    context = kc.CONTEXTS["240k"]
    pools = context // kc.KPOOL
    logits = torch.randn(rows, pools, device=kc.DEV)
    seq = (context - torch.arange(rows, device=kc.DEV) % 4).int()
    return logits, seq, torch.empty(rows, kc.WIDTH, dtype=torch.int32, device=kc.DEV)


def _decode_job(fmt, cfg, splits, rows=DECODE_ROWS):
    q, idx, out, lse = _decode_case(rows)
    plan = plan_sparse_mla_decode(rows, kc.HEADS_TP8, kc.WIDTH, _sms(), kv_format=fmt,
                                  config=cfg, num_splits=splits)
    ws = sparse_mla_decode_workspace([plan], kc.DEV)
    call = partial(sparse_mla_decode, q, _cache(fmt), idx, kc.SCALE, out, lse, plan, ws,
                   kv_scale=kc.kv_scale(fmt))
    moved = kc.mla_bytes(rows, kc.HEADS_TP8, fmt)
    return call, moved, {"kernel": "decode", "kv": fmt, "config": cfg.name, "rows": rows,
                         "splits": plan.num_splits}


def _indexer_job(cfg, requests, next_n):
    q, w, cache, bt, ctx, _, logits = _indexer_case(requests, next_n)
    call = partial(paged.indexer_logits_paged, q, w, cache, bt, ctx, logits, config=cfg)
    moved = kc.indexer_bytes(requests, next_n, kc.CONTEXTS["240k"] // kc.KPOOL)
    return call, moved, {"kernel": "indexer", "config": cfg.name, "requests": requests,
                         "next_n": next_n}


def _topk_job(cfg, rows):
    logits, seq, out = _topk_case(rows)
    extra = {}
    name = cfg if isinstance(cfg, str) else cfg.name
    if cfg == "radix-two-stage":
        extra = dict(config=topk.RADIX, workspace=topk.kpool_topk_workspace(
            rows, kc.TOPK // kc.KPOOL, _sms(), kc.DEV))
    elif cfg == "radix-one-pass":
        extra = dict(config=topk.RADIX)
    else:
        extra = dict(config=cfg)
    call = partial(topk.kpool_topk, logits, seq, out, kpool=kc.KPOOL,
                   select_pools=kc.TOPK // kc.KPOOL, **extra)
    return call, logits.numel() * 4, {"kernel": "topk", "config": name, "rows": rows}


KINDS = ("decode", "indexer", "topk")


def jobs(kinds=KINDS) -> list:
    """(builder, args) in a fixed order (shards index into it), for the kernels named."""
    out = []
    for fmt, cands in (DECODE_CANDIDATES.items() if "decode" in kinds else ()):
        for cfg in cands:
            for splits in DECODE_SPLITS:
                out.append((_decode_job, (fmt, cfg, splits)))
    for cfg in (paged.PAGED_CANDIDATES if "indexer" in kinds else ()):
        for requests, next_n in INDEXER_CASES:
            out.append((_indexer_job, (cfg, requests, next_n)))
    for cfg in (list(topk.TOPK_CANDIDATES) + ["radix-two-stage", "radix-one-pass"]
                if "topk" in kinds else ()):
        for rows in TOPK_ROWS:
            out.append((_topk_job, (cfg, rows)))
    return out


def warm(shard: int, shards: int, kinds=KINDS) -> None:
    """Compile (run once, untimed) every ``shards``-th job starting at ``shard``; the latent
    cache of one format is dropped before the next format's is made."""
    _COMPILE_ONLY[0] = True
    held = None
    for i, (build, args) in enumerate(jobs(kinds)):
        if i % shards != shard:
            continue
        fmt = args[0] if build is _decode_job else None
        if held is not None and fmt != held:
            torch.cuda.synchronize()
            _cache.cache_clear()
            torch.cuda.empty_cache()
        held = fmt
        try:
            build(*args)[0]()
        except Exception as exc:  # the timing process reports it
            print(f"warm {i}: {exc!r}", flush=True)
    torch.cuda.synchronize()


def sweep(results: dict, copy_bw: float, kinds=KINDS) -> None:
    """Time every job; rows go to results['sweep'] (us, frac_copy or error)."""
    rows = results.setdefault("sweep", [])
    for build, args in jobs(kinds):
        kc.check_deadline()
        try:
            call, moved, row = build(*args)
            t = kc.graph_time(call)
            row.update(us=t * 1e6, frac_copy=moved / t / copy_bw)
        except TimeoutError:
            raise
        except Exception as exc:
            row = {"kernel": build.__name__, "args": repr(args)[:200], "error": repr(exc)[:300]}
        rows.append(row)
        print("sweep " + json.dumps(row), flush=True)
    # The three fastest decode configs per format also at 8 and 128 rows (planner's splits).
    for fmt in (DECODE_CANDIDATES if "decode" in kinds else ()):
        timed = sorted((r for r in rows if r.get("kernel") == "decode" and r.get("kv") == fmt
                        and "us" in r and r["rows"] == DECODE_ROWS), key=lambda r: r["us"])
        names = list(dict.fromkeys(r["config"] for r in timed))[:3]
        for name in names:
            cfg = next(c for c in DECODE_CANDIDATES[fmt] if c.name == name)
            for n in (8, 128):
                kc.check_deadline()
                call, moved, row = _decode_job(fmt, cfg, None, rows=n)
                t = kc.graph_time(call)
                row.update(us=t * 1e6, frac_copy=moved / t / copy_bw)
                rows.append(row)
                print("sweep " + json.dumps(row), flush=True)


def best_table(results: dict) -> str:
    """The fastest configs per case, compact (printed last by the stage script)."""
    lines = [f"{'sweep case':<34}{'best config':<34}{'us':>8}{'%copy':>7}  runner-up"]
    groups: dict = {}
    for r in results.get("sweep", []):
        if "us" not in r:
            continue
        if r["kernel"] == "decode":
            key = f"decode {r['kv']} {r['rows']} rows"
            label = f"{r['config']} s{r['splits']}"
        elif r["kernel"] == "indexer":
            key = f"indexer {r['requests']}x{r['next_n']} 240k"
            label = r["config"]
        else:
            key = f"topk {r['rows']} rows 240k"
            label = r["config"]
        groups.setdefault(key, []).append((r["us"], r["frac_copy"], label))
    for key, found in groups.items():
        found.sort()
        us, frac, label = found[0]
        second = f"{found[1][2]} {found[1][0]:.1f}" if len(found) > 1 else ""
        lines.append(f"{key:<34}{label:<34}{us:>8.1f}{frac:>7.0%}  {second}")
    errors = [r for r in results.get("sweep", []) if "error" in r]
    if errors:
        lines.append(f"{len(errors)} sweep jobs failed (see the JSON), first: "
                     f"{errors[0]['args'][:60]} {errors[0]['error'][:80]}")
    return "\n".join(lines)
