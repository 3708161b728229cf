"""The kpool indexer op's selection step (`GlmctlKpoolIndexer._run`) on vLLM's real metadata
classes, with the CUDA kernel table run in the Triton interpreter and with the CPU table: a
decode batch (MTP rows) writes every row of the shared top-k buffer up to the padded token count
(its rows, then -1) and no row past it; the served rows are exactly the reference's on the
served logits; a mixed batch fills the rows the decode select does not own."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("vllm") is None:  # not importorskip: vLLM imports triton
    pytest.skip("needs vllm", allow_module_level=True)

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.indexer_logits_paged", "glmctl.kernels.kpool_topk",
    "glmctl.kernels.kpool_topk_packed")
pytestmark = pytest.mark.slow

KPOOL, TOPK, WIDTH, HEADS, PAGE_POOLS, PAGES_PER_REQ = 4, 64, 80, 4, 16, 7
UNTOUCHED = 99


def _vllm():
    from glmctl.plugin.platforms.cpu.env_fixes import serve_pil_image_processors

    serve_pil_image_processors()  # vLLM CPU's model package imports image processors
    import vllm.models.glm5next  # noqa: F401 - before the plugin's modules, as vLLM imports them
    from vllm.v1.attention.backends.mla import indexer as meta_mod

    from glmctl.plugin.attention import indexer

    return indexer, meta_mod


def _batch(gen, last_positions, next_n, prefill_tokens=0):
    """Decode requests (MTP rows in token order), an optional short prefill after them, the
    pool cache and the op's inputs; metadata as vLLM's builder makes it."""
    _, meta_mod = _vllm()
    batch = len(last_positions)
    n_dec = batch * next_n
    last = torch.tensor(last_positions)
    positions = (last[:, None] - (next_n - 1) + torch.arange(next_n)[None, :]).reshape(-1)
    positions = torch.cat([positions, torch.arange(prefill_tokens)])
    pages = batch * PAGES_PER_REQ + 1
    cache = torch.zeros(pages, PAGE_POOLS, 132, dtype=torch.uint8)
    cache[:, :, :128] = torch.randn(pages, PAGE_POOLS, 128, generator=gen).to(
        torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.exp2(torch.randint(-4, 1, (pages, PAGE_POOLS), generator=gen).float())
    cache[:, :, 128:] = scales.contiguous().view(torch.uint8).view(pages, PAGE_POOLS, 4)
    block_table = (torch.randperm(pages - 1, generator=gen)[: batch * PAGES_PER_REQ] + 1).view(
        batch, PAGES_PER_REQ).int()
    context = ((positions[:n_dec] + 1) // KPOOL).int().view(batch, next_n)
    decode = meta_mod.DeepSeekV32IndexerDecodeMetadata(
        block_table=block_table, seq_lens=context, decode_lens=torch.full((batch,), next_n),
        requires_padding=False, schedule_metadata=None)
    tokens = n_dec + prefill_tokens
    prefill = (meta_mod.DeepseekV32IndexerPrefillMetadata(chunks=[],
                                                          max_prefill_seq_len=prefill_tokens)
               if prefill_tokens else None)
    meta = meta_mod.DeepseekV32IndexerMetadata(
        seq_lens=last + 1, max_seq_len=int(last.max()) + 1,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), num_decodes=batch,
        num_decode_tokens=n_dec, num_prefills=1 if prefill_tokens else 0,
        num_prefill_tokens=prefill_tokens, decode=decode, prefill=prefill)
    q = torch.randn(tokens, HEADS, 128, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.randn(tokens, HEADS, generator=gen)
    return meta, cache, positions, q, weights


def _run(kernels, meta, cache, positions, q, weights, rows, monkeypatch):
    """The op's _run on a 12-row buffer: (buffer, the logits the paged kernel returned)."""
    indexer, _ = _vllm()
    ix = indexer.GlmctlKpoolIndexer.__new__(indexer.GlmctlKpoolIndexer)
    torch.nn.Module.__init__(ix)
    ix.k_cache = SimpleNamespace(prefix="layers.0.indexer.k_cache", kv_cache=cache)
    ix.tail_cache, ix.topk_tokens, ix.skip_k_cache_insert = None, TOPK, True
    ix.topk_indices_buffer = torch.full((12, WIDTH), UNTOUCHED, dtype=torch.int32)
    ix.topk_workspace = None
    seen = []
    served = kernels.logits_paged
    kernels.logits_paged = lambda *a: seen.append(served(*a)) or seen[-1]
    ix.kernels = kernels
    monkeypatch.setattr(indexer, "get_forward_context",
                        lambda: SimpleNamespace(attn_metadata={ix.k_cache.prefix: meta}))
    tokens = positions.shape[0]
    hidden = torch.zeros(rows, 8)
    k = torch.zeros(tokens, 128, dtype=torch.bfloat16)
    out = ix._run(hidden, q, k, weights, torch.zeros_like(k), torch.zeros(KPOOL, 128), KPOOL,
                  positions)
    return out, seen[0] if seen else None


def _check_decode_rows(buffer, logits, positions, context, n_dec):
    from glmctl.kernels.kpool_topk import kpool_topk_decode_ref

    want = torch.full((n_dec, WIDTH), 5, dtype=torch.int32)
    kpool_topk_decode_ref(torch.where(torch.isfinite(logits), logits, float("-inf")),
                          positions[:n_dec], context, want, kpool=KPOOL,
                          select_pools=TOPK // KPOOL)
    assert torch.equal(buffer[:n_dec], want)


@interpreted
@pytest.mark.parametrize("target,topk", [("TRITON", "packed"), ("TRITON", "threshold"), ("TORCH", None)])
def test_decode_batch_writes_its_rows_and_the_padding_rows_only(target, topk, monkeypatch):
    from glmctl.plugin.attention.kernel_table import indexer_kernels
    from glmctl.plugin.policy import Target

    gen = torch.Generator().manual_seed(4)
    meta, cache, positions, q, weights = _batch(gen, [401, 250, 130], next_n=2)
    n_dec, rows = 6, 9  # three padding rows after the batch (a CUDA-graph size)
    buffer, logits = _run(indexer_kernels(getattr(Target, target), topk=topk), meta, cache, positions, q,
                          weights, rows, monkeypatch)
    _check_decode_rows(buffer, logits, positions, meta.decode.seq_lens, n_dec)
    assert buffer[n_dec:rows].eq(-1).all()
    assert buffer[rows:].eq(UNTOUCHED).all()
    assert buffer[0, TOPK: TOPK + KPOOL - 1].tolist() == [400, -1, -1]  # 100 pools + 1 tail


@interpreted
@pytest.mark.parametrize("topk", ["packed", "threshold"])
def test_mixed_batch_fills_the_rows_the_decode_select_does_not_own(topk, monkeypatch):
    from glmctl.plugin.attention.kernel_table import indexer_kernels
    from glmctl.plugin.policy import Target

    gen = torch.Generator().manual_seed(6)
    meta, cache, positions, q, weights = _batch(gen, [300, 170], next_n=1, prefill_tokens=3)
    rows = 7  # 2 decode rows, 3 prefill rows, 2 padding rows
    buffer, logits = _run(indexer_kernels(Target.TRITON, topk=topk), meta, cache, positions, q, weights,
                          rows, monkeypatch)
    _check_decode_rows(buffer, logits, positions, meta.decode.seq_lens, 2)
    causal = torch.where(torch.arange(WIDTH)[None, :] <= torch.arange(3)[:, None],
                         torch.arange(WIDTH)[None, :], -1)
    assert torch.equal(buffer[2:5], causal.int())  # the short prefill: every token so far
    assert buffer[5:rows].eq(-1).all() and buffer[rows:].eq(UNTOUCHED).all()


def test_the_plugin_keeps_the_threshold_top_k_until_told():
    from glmctl.plugin.attention.kernel_table import indexer_topk

    assert indexer_topk({}) == "threshold"
    assert indexer_topk({"GLMCTL_INDEXER_TOPK": "packed"}) == "packed"
