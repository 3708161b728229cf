"""Every sparse-MLA decode configuration the bench sweeps (both kernels: heads as M and heads as
N; register prefetch, reloaded value tiles, each tile width) under TRITON_INTERPRET=1 against the
torch reference, on the three cache layouts; outputs poisoned with NaN first."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.mla_cache_write", "glmctl.kernels.sparse_mla_decode",
    "glmctl.kernels.sparse_mla_configs")
cache_write_mod, decode_mod, configs_mod = _modules or (None, None, None)


ROW = {"bf16": (512, torch.bfloat16), "fp8": (512, torch.uint8), "fp8_ds_mla": (656, torch.uint8)}


def _cache(fmt, num_blocks, block_size, kv_scale):
    row, dtype = ROW[fmt]
    backing = torch.zeros(num_blocks, block_size + 2, row, dtype=dtype)  # padded blocks
    cache = backing[:, :block_size]
    slots = torch.arange(num_blocks * block_size)
    latent = (torch.randn(len(slots), 512) * (1 + 3 * torch.rand(len(slots), 1))).to(
        torch.bfloat16)
    cache_write_mod.mla_cache_write_ref(latent, slots, cache, kv_scale)
    flat = (slots // block_size) * (block_size + 2) + slots % block_size
    return (cache.view(torch.float8_e4m3fn) if fmt == "fp8" else cache), flat


def _distinct(fmt):
    """The candidates that differ in what the interpreter can check (kernel, loop, tile)."""
    seen, out = set(), []
    table = configs_mod.DECODE_CANDIDATES[fmt] if configs_mod else []
    shipped = [c for (f, _), c in (configs_mod.DECODE_CONFIGS.items() if configs_mod else [])
               if f == fmt]
    for cfg in table + shipped:
        key = (cfg.layout, cfg.block_n, cfg.prefetch, cfg.reload, cfg.block_h)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


CASES = [(fmt, cfg) for fmt in ("fp8", "fp8_ds_mla", "bf16") for cfg in _distinct(fmt)]


@interpreted
@pytest.mark.parametrize("fmt, cfg", CASES, ids=[f"{f}-{c.name}" for f, c in CASES])
def test_decode_config_matches_reference(fmt, cfg):
    kv_scale = torch.tensor(0.041) if fmt == "fp8" else None
    cache, flat = _cache(fmt, num_blocks=6, block_size=16, kv_scale=kv_scale)
    heads = 8 if cfg.layout == "hn" or cfg.block_h == 16 else 20
    rows, width = 3, 2 * cfg.block_n + 24  # a partial last tile
    idx = flat[torch.randint(0, len(flat), (rows, width))].int()
    idx[0, 5::4] = -1  # holes
    idx[1] = -1  # nothing valid: zeros, lse -inf
    idx[2, 3] = 10**7  # out of range: ignored
    q = torch.randn(rows, heads, 512).to(torch.bfloat16)
    for splits in (1, 3):
        plan = decode_mod.plan_sparse_mla_decode(rows, heads, width, num_sms=4, kv_format=fmt,
                                                 config=cfg, num_splits=splits)
        ws = decode_mod.sparse_mla_decode_workspace([plan], "cpu")
        out = torch.full_like(q, float("nan"))
        lse = torch.full((rows, heads), float("nan"))
        decode_mod.sparse_mla_decode(q, cache, idx, 0.06, out, lse, plan, ws, kv_scale=kv_scale)
        want_out, want_lse = decode_mod.sparse_mla_decode_ref(q, cache, idx, 0.06,
                                                              kv_scale=kv_scale)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.allclose(out.float(), want_out.float(), atol=3e-2, rtol=2e-2), splits
        finite = torch.isfinite(want_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        assert torch.allclose(lse[finite], want_lse[finite], atol=2e-3, rtol=1e-4)
        assert bool((out[1] == 0).all())


@interpreted
@pytest.mark.parametrize("heads", [3, 16])
def test_heads_n_kernel_masks_padded_heads(heads):
    """Head counts that are not the head block (3 of 8) and the largest the kernel takes."""
    cfg = configs_mod.MLATileConfig("hn-test", 16, 4, 1, layout="hn")
    cache, flat = _cache("fp8_ds_mla", num_blocks=3, block_size=16, kv_scale=None)
    q = torch.randn(2, heads, 512).to(torch.bfloat16)
    idx = flat[torch.randint(0, len(flat), (2, 40))].int()
    plan = decode_mod.plan_sparse_mla_decode(2, heads, 40, num_sms=2, kv_format="fp8_ds_mla",
                                             config=cfg, num_splits=2)
    ws = decode_mod.sparse_mla_decode_workspace([plan], "cpu")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, heads), float("nan"))
    decode_mod.sparse_mla_decode(q, cache, idx, 0.06, out, lse, plan, ws)
    want_out, want_lse = decode_mod.sparse_mla_decode_ref(q, cache, idx, 0.06)
    assert torch.allclose(out.float(), want_out.float(), atol=3e-2, rtol=2e-2)
    assert torch.allclose(lse, want_lse, atol=2e-3, rtol=1e-4)


@interpreted
def test_heads_n_kernel_refuses_many_heads():
    cfg = configs_mod.MLATileConfig("hn-test", 16, 4, 1, layout="hn")
    with pytest.raises(ValueError, match="<= 16 heads"):
        decode_mod.plan_sparse_mla_decode(2, 32, 64, num_sms=2, kv_format="bf16", config=cfg)
