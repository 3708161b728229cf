"""The plugin's sparse-MLA backend computation on CUDA (Triton kernels) vs its CPU path (torch
references), with metadata built the way vLLM 0.30's builder builds it, including CUDA-graph
capture and replay of decode batches up to 48 tokens.

vLLM is not installed on the GPU test machine, so this drives `glmctl.plugin.attention.sparse_mla_compute`
(what `GlmctlSparseMLAImpl.forward_mqa` and the metadata builder call) directly:
  - request ids per token from the CPU query_start_loc (the builder's `request_ids_per_token`);
  - the indexer's shared top-k buffer: request-local positions, `topk + kpool - 1` wide padded
    to a multiple of 128 with -1 (vLLM's `topk_indices_buffer`), expanded pools + tail;
  - the latent cache exactly as vLLM binds it: `[num_blocks, block_size, 512]` bf16,
    `[num_blocks, block_size, 512]` fp8 (written as uint8, attended as vLLM's float8_e4m3fn view,
    with the layer's per-tensor `_k_scale` as a device scalar) or `[num_blocks, block_size, 656]`
    uint8 (`fp8_ds_mla`), as a strided view when other layers' pages sit between blocks; block
    tables from vLLM's block pool (any block order);
  - decode batches (<= 1 + 3 MTP tokens per request) through split-K decode with the plans and
    the one workspace the backend makes at construction (`make_decode_setup`, SM count from the
    device), everything else through the prefill kernel.

    python -m pytest -m gpu tests/gpu/test_plugin_sparse_mla_gpu.py   (make gpu-check)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from glmctl.plugin.attention.kernel_table import sparse_mla_kernels  # noqa: E402
from glmctl.plugin.attention.sparse_mla_compute import (  # noqa: E402
    decode_batch_sizes,
    make_decode_setup,
    request_ids_per_token,
    sparse_mla_forward,
)
from glmctl.plugin.policy import Target  # noqa: E402

pytestmark = pytest.mark.gpu

TOPK, KPOOL = 2048, 16
WIDTH = -(-(TOPK + KPOOL - 1) // 128) * 128  # 2176, vLLM's buffer width
BLOCK = 1024
SCALE = 256 ** -0.5  # GLM-5.3-Flash: qk head 256 (NoPE) -> softmax scale
MTP_QUERY_LEN = 4  # 1 + num_speculative_tokens (MTP-3)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48]
ROW = {"bf16": (512, torch.bfloat16), "fp8": (512, torch.uint8), "fp8_ds_mla": (656, torch.uint8)}


def _cache(num_blocks: int, fmt: str, device, interleave: int = 2):
    """A layer's latent cache view inside a page buffer shared with `interleave - 1` others."""
    width, dtype = ROW[fmt]
    pages = torch.zeros((num_blocks, interleave, BLOCK, width), dtype=dtype, device=device)
    return pages[:, 0]  # stride(0) = interleave * BLOCK * width


def _attended(cache, fmt):
    """The cache as vLLM's MLA layer hands it to forward_mqa (fp8: viewed as float8_e4m3fn)."""
    return cache.view(torch.float8_e4m3fn) if fmt == "fp8" else cache


def _kv_scale(fmt, device, value=0.0211):
    return torch.tensor(value, device=device) if fmt == "fp8" else None


def _decode_setup(triton_k, heads, fmt, device):
    """What GlmctlSparseMLAImpl makes at construction on CUDA (before any graph capture)."""
    sizes = decode_batch_sizes(CAPTURE_SIZES, 48)
    return make_decode_setup(triton_k, num_heads=heads, topk_width=WIDTH, kv_format=fmt,
                             batch_sizes=sizes, max_query_len=MTP_QUERY_LEN, device=device)


def _selection(seq_lens: list[int], tokens_per_req: int, gen: torch.Generator, device):
    """Index rows as the kpool indexer writes them, for the last `tokens_per_req` positions."""
    rows = []
    for seq in seq_lens:
        for j in range(tokens_per_req):
            pos = seq - tokens_per_req + j
            visible = (pos + 1) // KPOOL
            pools = torch.randperm(max(visible, 1), generator=gen)[: min(TOPK // KPOOL, visible)]
            pools = pools.sort().values if visible else pools[:0]
            toks = (pools[:, None] * KPOOL + torch.arange(KPOOL)).flatten()
            tail = torch.arange(visible * KPOOL, pos + 1)
            row = torch.full((WIDTH,), -1, dtype=torch.int32)
            row[: toks.numel()] = toks.to(torch.int32)
            row[TOPK : TOPK + tail.numel()] = tail.to(torch.int32)
            rows.append(row)
    return torch.stack(rows).to(device)


def _fill_cache(kernels, cache, latents, block_table, kv_scale=None):
    """Write every request's latents through the backend's cache-write kernel (vLLM's slots)."""
    for r, latent in enumerate(latents):
        pos = torch.arange(latent.shape[0])
        slots = block_table[r, pos // BLOCK].cpu().long() * BLOCK + pos % BLOCK
        kernels.cache_write(latent.to(cache.device), slots.to(cache.device), cache, kv_scale)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("heads, tokens_per_req", [(8, 1), (8, 4), (16, 1), (64, 4)])
def test_triton_backend_matches_the_torch_path(fmt, heads, tokens_per_req):
    """Eager: the cache write bit for bit, then the batch as a decode batch (split-K) and as a
    prefill batch (prefill kernel), each against the torch path."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(heads * 10 + tokens_per_req)
    seq_lens = [70_000, 3_000, 40]
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 3
    table_cols = max(-(-s // BLOCK) for s in seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is vLLM's null block
    block_table = torch.zeros((len(seq_lens), table_cols), dtype=torch.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // BLOCK)
        block_table[r, :n] = perm[used : used + n]
        used += n
    block_table = block_table.to(device)
    triton_k, torch_k = sparse_mla_kernels(Target.TRITON), sparse_mla_kernels(Target.TORCH)
    latents = [torch.randn(s, 512, generator=gen).to(torch.bfloat16) for s in seq_lens]
    kv_scale = _kv_scale(fmt, device)
    cache = _cache(num_blocks, fmt, device)
    _fill_cache(triton_k, cache, latents, block_table, kv_scale)
    ref_cache = _cache(num_blocks, fmt, device)
    _fill_cache(torch_k, ref_cache, latents, block_table, kv_scale)
    # The Triton cache write is the reference's bit for bit (IEEE divisions, RTNE, saturation:
    # vLLM's concat_and_cache_mla), so both paths below read the same cache.
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))

    qsl = torch.arange(0, len(seq_lens) + 1) * tokens_per_req
    req_ids = request_ids_per_token(qsl, torch.empty(64, dtype=torch.int32, device=device))
    topk = _selection(seq_lens, tokens_per_req, gen, device)
    q = torch.randn(topk.shape[0], heads, 512, generator=gen).to(torch.bfloat16).to(device)
    cache, ref_cache = _attended(cache, fmt), _attended(ref_cache, fmt)
    ref_out, ref_lse = sparse_mla_forward(q, ref_cache, topk, req_ids, block_table, BLOCK, SCALE,
                                          torch_k, kv_scale=kv_scale)
    setup = _decode_setup(triton_k, heads, fmt, device)
    plan = setup.plan_for(q.shape[0], tokens_per_req)
    assert plan is not None and plan.kv_format == fmt
    for max_query_len in (tokens_per_req, 1024):  # decode (split-K), prefill kernel
        out, lse = sparse_mla_forward(q, cache, topk, req_ids, block_table, BLOCK, SCALE,
                                      triton_k, kv_scale=kv_scale, decode=setup,
                                      max_query_len=max_query_len)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 48])
def test_decode_is_captured_in_a_cuda_graph_and_replays_with_new_batches(fmt, num_tokens):
    """Static buffers, as vLLM's FULL decode graph sees them: split-K decode (plan and
    workspace made before capture) is captured once per size, checked eagerly first, and
    replayed with new queries, selections, block tables, request layouts and (fp8) a new
    per-tensor scale, against the torch path."""
    device = torch.device("cuda")
    heads, num_blocks, cols = 8, 64, 16
    triton_k, torch_k = sparse_mla_kernels(Target.TRITON), sparse_mla_kernels(Target.TORCH)
    gen = torch.Generator().manual_seed(num_tokens)
    kv_scale = _kv_scale(fmt, device)
    write_scale = None if kv_scale is None else kv_scale.clone()
    cache = _cache(num_blocks, fmt, device)
    slots = (torch.arange(num_blocks)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    latent = (torch.randn(slots.numel(), 512, generator=gen) * 2).to(torch.bfloat16)
    triton_k.cache_write(latent.to(device), slots.to(device), cache, write_scale)
    cache = _attended(cache, fmt)
    per_req = MTP_QUERY_LEN if num_tokens % MTP_QUERY_LEN == 0 else 1
    setup = _decode_setup(triton_k, heads, fmt, device)
    plan = setup.plan_for(num_tokens, per_req)
    assert plan is not None and plan.num_tokens == num_tokens and plan.num_splits > 1
    q_buf = torch.zeros((num_tokens, heads, 512), dtype=torch.bfloat16, device=device)
    topk_buf = torch.full((num_tokens, WIDTH), -1, dtype=torch.int32, device=device)
    req_buf = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    table_buf = torch.zeros((num_tokens, cols), dtype=torch.int32, device=device)

    def new_batch(seed: int):
        g = torch.Generator().manual_seed(seed)
        reqs = num_tokens // per_req  # MTP-3 verifies 4 tokens per request
        seq_lens = torch.randint(per_req + 1, cols * BLOCK // 2, (reqs,), generator=g).tolist()
        table = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:cols] + 1
                             for _ in range(reqs)]).to(torch.int32)
        q_buf.copy_(torch.randn(q_buf.shape, generator=g).to(torch.bfloat16))
        topk_buf.copy_(_selection(seq_lens, per_req, g, device))
        request_ids_per_token(torch.arange(reqs + 1) * per_req, req_buf)
        table_buf.zero_()
        table_buf[:reqs].copy_(table)
        if kv_scale is not None:  # the graph must read the scale on the device
            kv_scale.fill_(0.0211 * (1 + seed % 3))

    def step(kernels, **decode):
        return sparse_mla_forward(q_buf, cache, topk_buf, req_buf, table_buf, BLOCK, SCALE,
                                  kernels, kv_scale=kv_scale, **decode)

    def check(out, lse):
        ref_out, ref_lse = step(torch_k)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)

    decode = dict(decode=setup, max_query_len=per_req)
    new_batch(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step(triton_k, **decode)  # eager (and compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    check(*eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(triton_k, **decode)
    for seed in range(1, 6):
        new_batch(seed)
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse)
