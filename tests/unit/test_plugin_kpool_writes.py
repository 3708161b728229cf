"""The CUDA kernel table's kpool tail seed on vLLM's real KV layout: the tail cache is a strided
view of the shared KV memory (vLLM's hybrid allocator pads every page to the model's largest, the
pooled indexer page), which vLLM's own seed kernel addresses as dense blocks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

RING, DIM, BLOCKS = 16, 128, 6
PAGE_ELEMS = 8448 // 2  # the tiny model's pooled indexer page (64 pools x 132 B), in bf16 elements


def _padded_tail(fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw pages, the [blocks, 2, ring, 128] view vLLM hands the tail layer)."""
    raw = torch.full((BLOCKS, PAGE_ELEMS), fill, dtype=torch.bfloat16)
    view = raw.as_strided((BLOCKS, 2, RING, DIM), (PAGE_ELEMS, RING * DIM, DIM, 1))
    return raw, view


def test_the_cuda_tables_tail_seed_honours_the_page_stride():
    from glmctl.plugin.platforms.cpu.env_fixes import serve_pil_image_processors

    serve_pil_image_processors()  # vLLM CPU's model package imports image processors (no torchvision here)
    import vllm.models.glm5next  # noqa: F401 - before the plugin's modules, as vLLM imports them
    from glmctl.kernels.kpool_cache_write import kpool_tail_seed_ref

    from glmctl.plugin.attention.kernel_table import _vllm_kpool_writes

    _, tail_seed, _ = _vllm_kpool_writes()
    torch.manual_seed(0)
    tokens = 45  # one request: two complete pools and a 13-token tail, in block 3
    k = torch.randn(tokens, DIM).to(torch.bfloat16)
    gate = torch.randn(tokens, DIM).to(torch.bfloat16)
    slots = (3 * RING + torch.arange(tokens) % RING).to(torch.int32)
    raw, view = _padded_tail(7.0)
    tail_seed(view, k, gate, slots, RING)  # vLLM's dense-block kernel would write block 2's padding
    want = torch.full((BLOCKS, 2, RING, DIM), 7.0, dtype=torch.bfloat16)
    kpool_tail_seed_ref(want, k, gate, slots, RING)
    assert torch.equal(view, want)
    assert (raw[:, 2 * RING * DIM:] == 7.0).all()  # the page padding (another layer's bytes) untouched
    assert torch.equal(view[3, 0, : tokens - 32], k[32:])  # the 13 tail tokens, in ring order
