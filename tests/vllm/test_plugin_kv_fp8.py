"""`--kv-cache-dtype fp8` with the glmctl plugin on vLLM CPU: the 512-byte FP8 MLA cache.

vLLM allocates its standard FP8 MLA cache for glmctl's sparse-MLA backend (512 e4m3 bytes per
token and layer, one per-tensor scale, the layer's `_k_scale`), the plugin writes it with the torch
reference of glmctl's cache-write kernel (vLLM CPU has no FP8 MLA cache write) and attends over it
with the reference sparse-MLA path. One extra server start; the bf16-KV baseline is the lane's
shared `tiny_server`.

Quality, measured (this machine, vLLM CPU 0.30.0, 2026-11-29): the tiny checkpoint (seed 0), the
prompt logprobs of the five prompts below (1,549 scored tokens), each KV layout's server against a
bf16-KV server, |d| in nats:

    KV cache                      bytes/token/layer   mean |d|   p99 |d|   max |d|   corr
    fp8 (this layout, k_scale 1)         512            0.089      1.13      1.77    0.9935
    fp8_ds_mla (per-128 scales)          656            0.074      0.75      1.46    0.9962

Both quantise to e4m3 with the same 3-bit mantissa; on the tiny model's latents (about N(0, 1)
after kv_a_layernorm, so k_scale = 1 leaves 1.3 % of them in e4m3's subnormal range) the latent
round trip errs by 2.67 % RMS (fp8) vs 2.57 % (fp8_ds_mla). The logprob gap between the two rows
is this random model amplifying different roundings, not a precision class apart. Bound asserted
for fp8 here: mean |d| <= 0.15 nats, max |d| <= 3 nats, correlation >= 0.985.
"""

from __future__ import annotations

import re

import pytest

from tests.vllm.plugin_servers import start_server
from tests.vllm.test_plugin_serving import PARITY_PROMPTS

pytestmark = pytest.mark.vllm

PROMPTS = dict(PARITY_PROMPTS, mixed=(
    "Once upon a time, in 1987, a programmer wrote: for i in range(10): print(i * 3.14159)\n" * 14))
KV_SPACE_BYTES = 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1 (plugin_servers)
MAX_MODEL_LEN = 4096  # plugin_servers


@pytest.fixture(scope="module")
def fp8_server(tiny_checkpoint, tmp_path_factory):
    srv = start_server(tiny_checkpoint.path, tmp_path_factory.mktemp("kv-fp8") / "vllm.log",
                       "--kv-cache-dtype", "fp8")
    yield srv
    srv.stop()


def test_fp8_server_generates_and_keeps_the_512_byte_layout(fp8_server):
    body = {"model": "tiny", "prompt": PROMPTS["sparse-text"], "max_tokens": 12,
            "temperature": 0, "logprobs": 1}
    choice = fp8_server.post("/v1/completions", body)["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 12
    assert all(x <= 0 for x in choice["logprobs"]["token_logprobs"])
    log = fp8_server.log_text()
    assert "kv_cache_dtype=fp8," in log  # the engine's config line
    assert "fp8_ds_mla" not in log  # vLLM logs a remapping; there is none for our backend


def test_fp8_kv_capacity_is_the_planners(fp8_server, tiny_checkpoint):
    """The KV tokens vLLM CPU reports for its 1 GiB are the planner's prediction for `fp8`
    (512 B per token per MLA layer), not what the 656-byte fp8_ds_mla record would give."""
    from glmctl.plan import kv_cache_layout, kv_capacity, load_model_spec

    match = re.search(r"CPU KV cache size: ([\d,]+) tokens", fp8_server.log_text())
    assert match, fp8_server.log_text()[-3000:]
    served = int(match.group(1).replace(",", ""))
    model = load_model_spec(tiny_checkpoint.path / "config.json")

    def predicted(dtype: str) -> int:
        layout = kv_cache_layout(model, tp=1, kv_cache_dtype=dtype, num_spec=0, mtp_layers=0,
                                 prefix_caching=False, kernel_block_size=16)
        return kv_capacity(layout, KV_SPACE_BYTES, MAX_MODEL_LEN).kv_tokens

    assert served == predicted("fp8")
    print(f"\nfp8 KV on vLLM CPU: {served:,} tokens in 1 GiB (planner: {predicted('fp8'):,}; "
          f"fp8_ds_mla would hold {predicted('fp8_ds_mla'):,})")
    assert served > 1.2 * predicted("fp8_ds_mla")


def test_fp8_prompt_logprobs_stay_close_to_bf16_kv(fp8_server, tiny_server):
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_server.checkpoint)
    fp8_all, bf16_all = [], []
    for name, text in PROMPTS.items():
        seq = tok(text)["input_ids"]
        body = {"model": "tiny", "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0}
        per_server = []
        for server in (fp8_server, tiny_server):
            plp = server.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
            per_server.append(np.array([e[str(t)]["logprob"]
                                        for e, t in zip(plp[1:], seq[1:], strict=True)]))
        d = np.abs(per_server[0] - per_server[1])
        print(f"{name:<12} {len(seq):>4} tokens: mean |d| {d.mean():.4f}, max {d.max():.3f}")
        fp8_all.append(per_server[0])
        bf16_all.append(per_server[1])
    fp8, bf16 = np.concatenate(fp8_all), np.concatenate(bf16_all)
    d = np.abs(fp8 - bf16)
    corr = float(np.corrcoef(fp8, bf16)[0, 1])
    print(f"all {d.size} tokens: mean |d| {d.mean():.4f}, p99 {np.quantile(d, 0.99):.3f}, "
          f"max {d.max():.3f}, corr {corr:.5f}")
    assert d.size > 1000
    assert d.mean() <= 0.15 and d.max() <= 3.0 and corr >= 0.985
