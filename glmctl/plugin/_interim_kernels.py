"""TEMPORARY torch stand-ins for the sparse-MLA / kpool-indexer kernels of issue 3.

Delete this module when `glmctl.kernels` provides the torch references (see
/work/notes/plugin-needs.md). The signatures and semantics follow vLLM 0.30's GPU ops for
GLM-5.3-Flash (models/glm5next/nvidia/ops/kpool_compress.py, DeepGEMM's MQA logits, _C's
top-k), so the plugin's adapters do not change when the real kernels replace these.

Layouts (as vLLM allocates them):
  indexer pool cache  uint8 [num_blocks, P, 132]; per block: P x 128 e4m3 values, then P fp32
                      scales (byte offset P * 128). Slot s -> block s // P, entry s % P.
  tail cache          bf16 [num_blocks, 2, kpool, 128]; [:, 0] raw K, [:, 1] gate score;
                      tail slot t -> block t // kpool, entry t % kpool.
  MLA cache           bf16 [num_blocks, block_size, 512|576] (rows addressed globally).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
INDEX_HEAD_DIM = 128


def _hadamard128(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard-128 along the last dim, fp32 butterflies (Sylvester order)."""
    shape = x.shape
    y = x.reshape(-1, 128).float()
    h = 1
    while h < 128:
        y = y.view(-1, 128 // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) * (1.0 / math.sqrt(128.0)))


def _quant_e4m3_rows(x: torch.Tensor, round_scale: bool = True):
    absmax = x.abs().amax(dim=-1).clamp_min(1e-4)
    scale = absmax / FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fwht128_quant_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = _hadamard128(q.float()).to(torch.bfloat16).float()
    qf, scale = _quant_e4m3_rows(x, round_scale=True)
    return qf, scale.unsqueeze(-1)


def _pool_cache_views(kv_cache: torch.Tensor, head_dim: int):
    """(values [B, P, head_dim] e4m3, scales [B, P] fp32) views of the pool cache."""
    num_blocks, page, _ = kv_cache.shape
    flat = kv_cache.reshape(num_blocks, -1)
    values = flat[:, : page * head_dim].view(torch.float8_e4m3fn).view(num_blocks, page, head_dim)
    scales = flat[:, page * head_dim : page * (head_dim + 4)].view(torch.float32)
    return values, scales


def _compress_pools(k_pools, gate_pools, ape, round_scale=True):
    logits = gate_pools.float() + ape.float()
    prob = torch.softmax(logits, dim=1)
    x = (prob * k_pools.float()).sum(dim=1).to(torch.bfloat16).float()
    x = _hadamard128(x).to(torch.bfloat16).float()
    return _quant_e4m3_rows(x, round_scale)


def _write_pools(kv_cache, loc, qv, scale, head_dim):
    values, scales = _pool_cache_views(kv_cache, head_dim)
    page = kv_cache.shape[1]
    blk, off = loc // page, loc % page
    values[blk, off] = qv
    scales[blk, off] = scale


def kpool_compress_and_write_cache(kv_cache, slot_k, slot_score, ape, loc, pool_size,
                                   head_dim=INDEX_HEAD_DIM, write_mask=None, round_scale=True):
    if slot_k.shape[0] == 0:
        return
    if write_mask is not None:
        keep = write_mask.nonzero().squeeze(-1)
        slot_k, slot_score, loc = slot_k[keep], slot_score[keep], loc[keep]
    qv, scale = _compress_pools(slot_k, slot_score, ape, round_scale)
    _write_pools(kv_cache, loc.long(), qv, scale, head_dim)


def kpool_seed_tail_cache(tail_kv_cache, key, gate_score, tslot, kpool, head_dim=INDEX_HEAD_DIM):
    n = tslot.shape[0]
    if n == 0:
        return
    t = tslot.long()
    ahead = torch.full_like(t, -1)
    if n > kpool:
        ahead[: n - kpool] = t[kpool:]
    in_tail = (t >= 0) & ((ahead < 0) | (torch.div(ahead, kpool, rounding_mode="floor")
                                         != torch.div(t, kpool, rounding_mode="floor")))
    idx = in_tail.nonzero().squeeze(-1)
    blk, off = t[idx] // kpool, t[idx] % kpool
    tail_kv_cache[blk, 0, off] = key[idx].to(tail_kv_cache.dtype)
    tail_kv_cache[blk, 1, off] = gate_score[idx].to(tail_kv_cache.dtype)


def kpool_decode_update_and_maybe_write_cache_batched(kv_cache, tail_kv_cache, tail_slot_mapping,
                                                      key, slot_score, ape, slot_mapping, positions,
                                                      pool_size, head_dim=INDEX_HEAD_DIM,
                                                      round_scale=True):
    num_requests, next_n = key.shape[:2]
    for r in range(num_requests):
        for t in range(next_n):
            pos = int(positions[r, t])
            tslot = int(tail_slot_mapping[r, t])
            loc = int(slot_mapping[r, t])
            if pos < 0 or tslot < 0:
                continue
            blk, phase = tslot // pool_size, pos % pool_size
            if loc >= 0 and phase == pool_size - 1:
                ks = tail_kv_cache[blk, 0].float().clone()
                gs = tail_kv_cache[blk, 1].float().clone()
                ks[phase], gs[phase] = key[r, t].float(), slot_score[r, t].float()
                qv, scale = _compress_pools(ks[None], gs[None], ape, round_scale)
                _write_pools(kv_cache, torch.tensor([loc]), qv, scale, head_dim)
            tail_kv_cache[blk, 0, phase] = key[r, t]
            tail_kv_cache[blk, 1, phase] = slot_score[r, t]


def gather_indexer_k_cache(kv_cache, block_table, cu_seq_lens, total, head_dim=INDEX_HEAD_DIM):
    """Pool entries of each request, concatenated: (values [N, hd] e4m3, scales [N] fp32)."""
    values, scales = _pool_cache_views(kv_cache, head_dim)
    page = kv_cache.shape[1]
    cu = cu_seq_lens.tolist()
    out_v, out_s = [], []
    for r in range(len(cu) - 1):
        n = cu[r + 1] - cu[r]
        idx = torch.arange(n, device=kv_cache.device)
        blk = block_table[r, idx // page].long()
        out_v.append(values[blk, idx % page])
        out_s.append(scales[blk, idx % page])
    return torch.cat(out_v)[:total], torch.cat(out_s)[:total]


def mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke):
    """[M, N]: sum_h w[m,h] * relu(q[m,h] . k[n]) * k_scale[n], -inf outside [ks, ke)."""
    scores = torch.einsum("mhd,nd->mhn", q_fp8.float(), k_fp8.float()).relu()
    logits = torch.einsum("mhn,mh->mn", scores, weights.float()) * k_scale.float()[None]
    cols = torch.arange(k_fp8.shape[0], device=q_fp8.device)[None]
    inside = (cols >= ks[:, None]) & (cols < ke[:, None])
    return logits.masked_fill(~inside, float("-inf"))


def paged_mqa_logits(q_fp8, kv_cache, weights, context_lens, block_table, max_model_len,
                     head_dim=INDEX_HEAD_DIM):
    """q [B, n, H, d]; context_lens [B, n] (pool-granular); -> [B*n, max_model_len]."""
    batch, next_n = q_fp8.shape[:2]
    values, scales = _pool_cache_views(kv_cache, head_dim)
    page = kv_cache.shape[1]
    out = torch.full((batch * next_n, max_model_len), float("-inf"), device=q_fp8.device)
    lens = context_lens.reshape(batch, next_n)
    for b in range(batch):
        n = int(lens[b].max())
        if n <= 0:
            continue
        idx = torch.arange(n, device=q_fp8.device)
        blk = block_table[b, idx // page].long()
        kv, ksc = values[blk, idx % page], scales[blk, idx % page]
        for t in range(next_n):
            row = b * next_n + t
            m = int(lens[b, t])
            if m <= 0:
                continue
            out[row, :m] = mqa_logits(q_fp8[b, t][None], kv[:m], ksc[:m], weights[row][None],
                                      torch.zeros(1, dtype=torch.int32), torch.full((1,), m))[0]
    return out


def top_k_rows(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, k: int):
    """Per row, the top-k column offsets (relative to `starts`) in [starts, ends); -1 padded."""
    rows, width = logits.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    cols = torch.arange(width, device=logits.device)[None]
    valid = (cols >= starts[:, None]) & (cols < ends[:, None])
    masked = logits.masked_fill(~valid, float("-inf"))
    kk = min(k, width)
    vals, idx = masked.topk(kk, dim=-1)
    rel = (idx - starts[:, None]).to(torch.int32)
    out[:, :kk] = torch.where(torch.isfinite(vals) & (vals > float("-inf")), rel, -1)
    # A row with fewer than k valid columns keeps exactly its valid ones.
    count = valid.sum(-1)
    pos = torch.arange(k, device=logits.device)[None]
    return torch.where(pos < count[:, None], out, -1)


def expand_pools_and_append_tail(pool_ids, seq_lens, pool_size):
    rows, groups = pool_ids.shape
    topk = groups * pool_size
    offs = torch.arange(pool_size, device=pool_ids.device)
    hist = pool_ids.long().unsqueeze(-1) * pool_size + offs
    hist = torch.where(pool_ids.unsqueeze(-1) >= 0, hist, -1).reshape(rows, topk)
    seq = seq_lens.long()
    tail_start = (seq // pool_size) * pool_size
    tail_off = torch.arange(pool_size - 1, device=pool_ids.device)[None]
    tail = torch.where(tail_off < (seq - tail_start)[:, None], tail_start[:, None] + tail_off, -1)
    return torch.cat([hist, tail], dim=1).to(torch.int32)


def sparse_mla_attention(q, kv_rows, slots, softmax_scale, kv_cache_dtype="auto"):
    """q [T, H, D]; kv_rows [R, D] (flat rows of the MLA cache); slots [T, W] (-1 invalid).

    Returns (out [T, H, kv_lora=512], lse [T, H]); V is the first 512 latent dims.
    """
    if kv_cache_dtype not in ("auto", "bfloat16"):
        raise NotImplementedError("interim sparse MLA: bf16 KV cache only")
    valid = slots >= 0
    rows = kv_rows[slots.clamp_min(0).long()].float()  # [T, W, D]
    scores = torch.einsum("thd,twd->thw", q.float(), rows) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    prob = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("thw,twd->thd", prob, rows[..., :512])
    return out.to(q.dtype), lse


def mla_cache_write(kv_c, k_pe, kv_rows, rows, kv_cache_dtype="auto"):
    """Write latent rows: kv_rows[rows[t]] = [kv_c[t] | k_pe[t]]; rows < 0 are skipped."""
    if kv_cache_dtype not in ("auto", "bfloat16"):
        raise NotImplementedError("interim MLA cache write: bf16 KV cache only")
    keep = (rows >= 0).nonzero().squeeze(-1)
    values = torch.cat([kv_c, k_pe.reshape(kv_c.shape[0], -1)], dim=-1)
    kv_rows[rows[keep].long()] = values[keep].to(kv_rows.dtype)
