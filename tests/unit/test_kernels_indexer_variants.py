"""Every paged indexer-logits configuration the bench sweeps (the page-grid kernel at each tile
shape, with and without register prefetch; the balanced kernel) under TRITON_INTERPRET=1 against
the torch reference, for one and four query tokens per request (MTP), across page boundaries and
with a request that has no complete pool."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.indexer_logits_paged")
(paged,) = _modules or (None,)


def _pool_cache(num_pages, page_pools, pad_bytes=0):
    backing = torch.zeros(num_pages, page_pools * 132 + pad_bytes, dtype=torch.uint8)
    backing[:, : page_pools * 128] = (
        torch.randn(num_pages, page_pools * 128).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    scales = torch.exp2(torch.randint(-7, 1, (num_pages, page_pools)).float())
    backing[:, page_pools * 128 : page_pools * 132] = scales.view(torch.uint8).view(num_pages, -1)
    return backing[:, : page_pools * 132].view(num_pages, page_pools, 132)


CONFIGS = (paged.PAGED_CANDIDATES + list(paged.PAGED_CONFIGS.values())) if paged else []


@interpreted
@pytest.mark.parametrize("next_n", [1, 4])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_paged_logits_config_matches_reference(cfg, next_n):
    page_pools, pages = 16, 9
    cache = _pool_cache(2 * pages + 1, page_pools, pad_bytes=12)
    num_req, heads = 3, 16
    q = torch.randn(num_req, next_n, heads, 128).to(torch.float8_e4m3fn)
    w = torch.randn(num_req * next_n, heads)
    block_table = torch.stack([torch.randperm(2 * pages + 1)[:pages] for _ in range(num_req)])
    block_table = block_table.int()
    # A long request past several tiles, one without a complete pool, one mid-page.
    last = torch.tensor([pages * page_pools - 1, 0, 2 * page_pools + 5])
    ctx = (last[:, None] - (next_n - 1) + torch.arange(next_n)[None, :]).clamp_min(0).int()
    out = torch.full((num_req * next_n, pages * page_pools), float("nan"))
    paged.indexer_logits_paged(q, w, cache, block_table, ctx.contiguous(), out, num_programs=3,
                               config=cfg)
    want = paged.indexer_logits_paged_ref(q, w, cache, block_table, ctx)
    visible = torch.isfinite(want)
    assert not torch.isnan(out[visible]).any()
    assert torch.allclose(out[visible], want[visible], rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[~visible]).all()  # nothing written past a row's context
