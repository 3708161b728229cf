"""The decode top-k and the indexer's decode selection, new against previous, at one TP8 rank's
decode shapes of GLM-5.3-Flash with MTP-3 (4 query rows per request): 8x22k, 1x64k, 8x64k,
8x227k. Select 128 pools of 16 tokens into 2176-wide rows; 32 indexer heads; pool pages of 64.

Per cell, on logits the paged indexer kernel computed from a random pool cache:
* ``topk``: the previous kernel (threshold, `THRESHOLD_CONFIG`) on int32 lengths against the
  packed-counter kernel (`kpool_topk_decode`, every `PACKED_CANDIDATES` entry: the sweep);
* ``step``: the indexer's decode selection as it was (a fill of the buffer, torch length
  arithmetic, paged logits, threshold top-k) against the glue-free one (paged logits, one
  `kpool_topk_decode` launch writing every row), 3 CUDA-graph padding rows;
* ``rows``: the sparse-MLA backend's positions -> cache rows, torch ops (`sparse_rows_ref`)
  against the Triton kernel (`sparse_rows`), 64-token blocks;
* ``update``: the MTP ring update (`kpool_decode_update`, 18-slot ring, int64 positions), the
  kernel the step runs before its selection (to set against the rank-sim profile of main at
  53eef26 on the H200: 59 us per 14 calls, 4.2 us each, in vLLM at 8x22k).
Each figure is the median of 7 replays of a CUDA graph holding 20 calls, over 20 (measured,
torch.cuda.Event). Outputs of new and previous are compared (``agree``). The per-step figures
multiply by 14 calls (11 indexed-attention layers and the MTP layer's 3 passes): predicted,
and an upper bound, since the drafter's passes run on fewer rows.

    python bench/gpu/topk_bench.py [--out FILE.json] [--seconds 130]

Writes JSON to --out (default $OUT/topk-h200.json, else out/topk-h200.json); the table is last.
Success: ``agree`` everywhere, the packed top-k and the glue-free step faster in every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.kernels_common import DEADLINE, graph_time  # noqa: E402

TOPK, KPOOL, WIDTH, SELECT = 2048, 16, 2176, 128
PAGE_POOLS, HEADS, BLOCK_SIZE, PAD_ROWS = 64, 32, 64, 3
CALLS_PER_STEP = 14
CELLS = {"8x22k": (8, 4, 22 * 1024), "1x64k": (1, 4, 64 * 1024), "8x64k": (8, 4, 64 * 1024),
         "8x227k": (8, 4, 227 * 1024)}
ITERS, REPS = 20, 7
DEV = "cuda"


def graph_us(fn) -> float:
    """Microseconds per call: ITERS calls captured in one CUDA graph, median of REPS replays."""
    return graph_time(fn, ITERS, REPS, statistics.median) * 1e6


def build(cell: str, seed: int = 0) -> dict:
    """A cell's indexer inputs: pool cache, block table, fp8 queries, weights, int64 positions
    (the last tokens of each request's context), int32 pool-granular context lengths."""
    requests, next_n, context = CELLS[cell]
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages_per_req = -(-(context // KPOOL + 1) // PAGE_POOLS)
    pages = requests * pages_per_req + 1
    cache = torch.zeros(pages, PAGE_POOLS, 132, dtype=torch.uint8, device=DEV)
    flat = cache.view(pages, -1)
    flat[:, : PAGE_POOLS * 128] = torch.randn(pages, PAGE_POOLS * 128, generator=g,
                                              device=DEV).to(torch.float8_e4m3fn).view(
                                                  torch.uint8)
    scales = torch.exp2(torch.randint(-9, -2, (pages, PAGE_POOLS), generator=g,
                                      device=DEV).float())
    flat[:, PAGE_POOLS * 128:] = scales.view(torch.uint8).view(pages, -1)
    table = (torch.randperm(pages - 1, generator=g, device=DEV) + 1).view(requests, -1).int()
    last = context - torch.randint(0, 2 * KPOOL, (requests,), generator=g, device=DEV)
    positions = (last[:, None] - (next_n - 1) + torch.arange(next_n, device=DEV)[None])
    positions = positions.reshape(-1).long()
    ctx = ((positions + 1) // KPOOL).int().view(requests, next_n).contiguous()
    q = torch.randn(requests, next_n, HEADS, 128, generator=g, device=DEV).to(
        torch.float8_e4m3fn)
    w = torch.randn(requests * next_n, HEADS, generator=g, device=DEV)
    # the sparse-MLA side: request-local selections, request ids, the latent cache's table
    blocks_per_req = -(-context // BLOCK_SIZE)
    mla_table = torch.randperm(requests * blocks_per_req, generator=g, device=DEV).view(
        requests, -1).int()
    req_ids = torch.arange(requests, device=DEV).repeat_interleave(next_n).int()
    return dict(cache=cache, table=table, positions=positions, ctx=ctx, q=q, w=w,
                mla_table=mla_table, req_ids=req_ids, rows=requests * next_n)


def paged_logits(d):
    from glmctl.kernels.indexer_logits_paged import indexer_logits_paged

    q = d["q"]
    out = torch.empty(q.shape[0] * q.shape[1], d["table"].shape[1] * PAGE_POOLS, device=DEV)
    return indexer_logits_paged(q, d["w"], d["cache"], d["table"], d["ctx"], out)


def previous_step(d, buffer):
    """The indexer's decode selection as it was before the glue-free path."""
    from glmctl.kernels.kpool_topk import THRESHOLD_CONFIG, kpool_topk

    n = d["rows"]
    buffer[: n + PAD_ROWS] = -1
    seq = d["positions"][:n].to(torch.int32) + 1
    logits = paged_logits(d)
    seq = torch.minimum(seq, (d["ctx"].reshape(-1).to(torch.int32) + 1) * KPOOL - 1)
    kpool_topk(logits, seq, buffer[:n], kpool=KPOOL, select_pools=SELECT,
               config=THRESHOLD_CONFIG)


def glue_free_step(d, buffer, config=None):
    from glmctl.kernels.kpool_topk import kpool_topk_decode

    n = d["rows"]
    kpool_topk_decode(paged_logits(d), d["positions"], d["ctx"], buffer[: n + PAD_ROWS],
                      kpool=KPOOL, select_pools=SELECT, valid_rows=n, config=config)


def ring_update(d):
    """The MTP tail-ring update of one step (each request's 4 tokens; one completes a pool)."""
    from glmctl.kernels.kpool_decode_write import kpool_decode_update

    requests, next_n = d["ctx"].shape
    ring = KPOOL + next_n - 2
    g = torch.Generator(device=DEV).manual_seed(1)
    tail = torch.randn(requests, 2, ring, 128, generator=g, device=DEV).to(torch.bfloat16)
    pos = d["positions"].view(requests, next_n)
    pool = pos // KPOOL
    per_req = d["cache"].shape[0] * PAGE_POOLS // requests  # disjoint pool slots per request
    own = torch.arange(requests, device=DEV)[:, None] * per_req + pool % per_req
    slots = torch.where((pos + 1) % KPOOL == 0, own, -1)
    tail_slots = torch.arange(requests, device=DEV)[:, None] * ring + pos % ring
    k = torch.randn(requests, next_n, 128, generator=g, device=DEV).to(torch.bfloat16)
    gate = torch.randn(requests, next_n, 128, generator=g, device=DEV).to(torch.bfloat16)
    ape = torch.randn(KPOOL, 128, generator=g, device=DEV)
    cache = d["cache"].clone()
    return lambda: kpool_decode_update(cache, tail, tail_slots, k, gate, ape, slots, pos, KPOOL)


def bench_cell(cell: str) -> dict:
    from glmctl.kernels.kpool_topk import THRESHOLD_CONFIG, kpool_topk, kpool_topk_decode
    from glmctl.kernels.kpool_topk_packed import PACKED_CANDIDATES, PACKED_CONFIG
    from glmctl.kernels.sparse_slots import sparse_rows, sparse_rows_ref

    d = build(cell)
    n = d["rows"]
    logits = paged_logits(d)
    seq = torch.minimum(d["positions"] + 1, (d["ctx"].reshape(-1).long() + 1) * KPOOL - 1).int()
    out = torch.empty(n + PAD_ROWS, WIDTH, dtype=torch.int32, device=DEV)
    row = dict(cell=cell, rows=n, pools=int(d["ctx"].max()), errors=[])

    def timed(key, fn):
        try:
            row[key] = round(graph_us(fn), 2)
        except Exception as exc:  # noqa: BLE001 - a failing case is recorded, the rest runs
            row["errors"].append(f"{key}: {type(exc).__name__}: {str(exc)[:160]}")

    timed("topk_threshold_us", lambda: kpool_topk(logits, seq, out[:n], kpool=KPOOL,
                                                  select_pools=SELECT, config=THRESHOLD_CONFIG))
    sweep = {}
    for cfg in PACKED_CANDIDATES:
        key = f"topk_{cfg.name}_us"
        timed(key, lambda cfg=cfg: kpool_topk_decode(logits, d["positions"], d["ctx"], out,
                                                     kpool=KPOOL, select_pools=SELECT,
                                                     valid_rows=n, config=cfg))
        if key in row:
            sweep[cfg.name] = row.pop(key)
    row["topk_sweep_us"] = sweep
    row["topk_packed_us"] = sweep.get(PACKED_CONFIG.name)
    buf_prev = torch.full((n + PAD_ROWS + 2, WIDTH), 7, dtype=torch.int32, device=DEV)
    buf_new = buf_prev.clone()
    timed("step_previous_us", lambda: previous_step(d, buf_prev))
    timed("step_glue_free_us", lambda: glue_free_step(d, buf_new))
    timed("logits_us", lambda: paged_logits(d))
    # the rows the sparse-MLA backend maps: this cell's selections
    sel = torch.full((n, WIDTH), -1, dtype=torch.int32, device=DEV)
    kpool_topk_decode(logits, d["positions"], d["ctx"], sel, kpool=KPOOL, select_pools=SELECT)
    args = (sel, d["req_ids"], d["mla_table"], BLOCK_SIZE, BLOCK_SIZE)
    timed("rows_torch_us", lambda: sparse_rows_ref(*args))
    timed("rows_triton_us", lambda: sparse_rows(*args))
    timed("update_us", ring_update(d))
    # agreement: previous and new outputs, bit for bit
    torch.cuda.synchronize()
    prev = torch.full_like(buf_prev, 7)
    new = torch.full_like(buf_prev, 7)
    previous_step(d, prev)
    glue_free_step(d, new)
    rows_ok = torch.equal(sparse_rows(*args), sparse_rows_ref(*args))
    row["agree"] = bool(torch.equal(prev, new) and rows_ok)
    for kind in ("previous", "glue_free"):
        us = row.get(f"step_{kind}_us")
        rows_us = row.get("rows_torch_us" if kind == "previous" else "rows_triton_us")
        if us is not None and rows_us is not None:
            row[f"per_step_{kind}_us"] = round(CALLS_PER_STEP * (us + rows_us), 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "topk-h200.json"))
    ap.add_argument("--seconds", type=float, default=130.0, help="time budget; later cases skip")
    ap.add_argument("--cells", default=",".join(CELLS))
    args = ap.parse_args()
    start = time.time()
    DEADLINE[0] = start + args.seconds  # kernels_common's: graph_time skips cases past it
    import triton

    device = torch.cuda.get_device_name()
    rows = []
    for cell in args.cells.split(","):
        try:
            rows.append(bench_cell(cell))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(cell=cell, errors=[f"{type(exc).__name__}: {str(exc)[:200]}"]))
        print(f"{cell}: {json.dumps(rows[-1])}", flush=True)
        torch.cuda.empty_cache()
    record = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  how=f"CUDA-graph replays of {ITERS} calls, median of {REPS}, per call",
                  per_step=f"predicted: {CALLS_PER_STEP} calls x (indexer selection + rows "
                           "mapping) at the target's rows (an upper bound)",
                  seconds=round(time.time() - start, 1), cells=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)

    def fmt(value, width=8):
        return f"{value:>{width}.1f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    names = sorted({k for r in rows for k in r.get("topk_sweep_us", {})})
    print("packed candidates, us per call: " + ", ".join(names))
    for r in rows:
        print(f"  {r['cell']:<7}" + "".join(fmt(r.get("topk_sweep_us", {}).get(k)) for k in names))
    print(f"{device}; us per call (graph replays); per step = {CALLS_PER_STEP} calls (predicted)")
    print(f"{'cell':<7}{'rows':>5}{'topk thr':>9}{'packed':>8}{'step prev':>10}{'new':>8}"
          f"{'rows torch':>11}{'triton':>8}{'/step prev':>11}{'new':>8}{'update':>8}  agree")
    for r in rows:
        print(f"{r['cell']:<7}{r.get('rows', 0):>5}{fmt(r.get('topk_threshold_us'), 9)}"
              f"{fmt(r.get('topk_packed_us'))}{fmt(r.get('step_previous_us'), 10)}"
              f"{fmt(r.get('step_glue_free_us'))}{fmt(r.get('rows_torch_us'), 11)}"
              f"{fmt(r.get('rows_triton_us'))}{fmt(r.get('per_step_previous_us'), 11)}"
              f"{fmt(r.get('per_step_glue_free_us'))}{fmt(r.get('update_us'))}"
              f"  {r.get('agree', '-')}"
              + (f"  errors: {len(r['errors'])}" if r.get("errors") else ""))
    ok = all(r.get("agree") for r in rows)
    print(f"all agree: {ok}; {time.time() - start:.0f} s; JSON: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
