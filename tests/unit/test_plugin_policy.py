"""When the plugin acts (pure rules, no vLLM)."""

from __future__ import annotations

import pytest
from glmctl.kernels.layouts import kpool_block_size, kpool_tail_ring

from glmctl.plugin.policy import (
    MhcPath,
    PlatformFacts,
    PluginMode,
    Target,
    decide_mhc_path,
    decide_platform,
    is_glm5_next,
)


@pytest.mark.parametrize(
    "raw, mode",
    [(None, PluginMode.AUTO), ("", PluginMode.AUTO), ("AUTO", PluginMode.AUTO), ("on", PluginMode.ON),
     ("1", PluginMode.ON), ("off", PluginMode.OFF), ("false", PluginMode.OFF)],
)
def test_mode_parsing(raw, mode):
    assert PluginMode.parse(raw) is mode


def test_unknown_mode_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="GLMCTL_PLUGIN='sometimes'"):
        PluginMode.parse("sometimes")


@pytest.mark.parametrize(
    "mode, facts, act, target",
    [
        (PluginMode.AUTO, PlatformFacts("cpu"), True, Target.TORCH),
        (PluginMode.AUTO, PlatformFacts("cuda", (8, 9)), True, Target.TRITON),
        (PluginMode.AUTO, PlatformFacts("cuda", (8, 0)), True, Target.TRITON),
        (PluginMode.AUTO, PlatformFacts("cuda", (9, 0)), False, None),
        (PluginMode.AUTO, PlatformFacts("cuda", (10, 0)), False, None),
        (PluginMode.ON, PlatformFacts("cuda", (9, 0)), True, Target.TRITON),
        (PluginMode.OFF, PlatformFacts("cpu"), False, None),
        (PluginMode.OFF, PlatformFacts("cuda", (8, 9)), False, None),
        (PluginMode.ON, PlatformFacts("rocm"), False, None),
    ],
)
def test_platform_decision(mode, facts, act, target):
    decision = decide_platform(mode, facts)
    assert decision.act is act and decision.target is target
    assert decision.reason


def test_sm90_auto_says_how_to_opt_in():
    assert "GLMCTL_PLUGIN=on" in decide_platform(PluginMode.AUTO, PlatformFacts("cuda", (9, 0))).reason


@pytest.mark.parametrize(
    "model_type, archs, expected",
    [
        ("glm5_next", ["Glm5NextForCausalLM"], True),
        ("glm5_next_text", None, True),
        ("glm5_next_mtp", ["Glm5NextMTPModel"], True),
        (None, ["Glm5NextForConditionalGeneration"], True),
        ("llama", ["LlamaForCausalLM"], False),
        ("deepseek_v32", ["DeepseekV32ForCausalLM"], False),
    ],
)
def test_model_recognition(model_type, archs, expected):
    assert is_glm5_next(model_type, archs) is expected


@pytest.mark.parametrize(
    "block, kpool, head_dim, expected",
    [
        (16, 16, 128, 1024),  # 32 * 16 = 512 is too small for the tail page (8 KiB > 32 * 132 B)
        (16, 4, 128, 128),
        (2048, 16, 128, 2048),
        (1100, 16, 128, 1536),
        (16, None, 128, 16),
        (16, 1, 128, 16),
    ],
)
def test_kpool_block_size(block, kpool, head_dim, expected):
    size = kpool_block_size(block, kpool, head_dim)
    assert size == expected
    if kpool and kpool > 1:
        assert size % (32 * kpool) == 0
        assert (size // kpool) * (head_dim + 4) >= 2 * kpool * head_dim * 2


@pytest.mark.parametrize("kpool, drafts, ring", [(16, 0, 16), (16, 1, 16), (16, 3, 18),
                                                 (4, 3, 6), (4, 8, 11), (None, 3, 0)])
def test_kpool_tail_ring(kpool, drafts, ring):
    assert kpool_tail_ring(kpool, drafts) == ring


def test_kpool_block_size_fits_the_mtp_tail_ring():
    # The tiny checkpoint, bf16 KV: one pool's tail (8 KiB) fits 1024-token blocks; MTP-3's
    # 18-slot ring (9 KiB) needs 1536.
    assert kpool_block_size(16, 16, 128) == 1024
    assert kpool_block_size(16, 16, 128, num_speculative_tokens=3) == 1536
    assert kpool_block_size(2048, 16, 128, num_speculative_tokens=3) == 2048


@pytest.mark.parametrize("raw, target, cap, tilelang, expected", [
    (None, Target.TORCH, None, False, MhcPath.TORCH),
    ("triton", Target.TORCH, None, True, MhcPath.TORCH),  # vLLM CPU has only the torch path
    (None, Target.TRITON, (8, 9), True, MhcPath.TRITON),  # sm_89: glmctl's Triton kernels
    (None, Target.TRITON, (8, 9), False, MhcPath.TRITON),
    (None, Target.TRITON, (9, 0), False, MhcPath.TRITON),  # no tilelang: never call it
    (None, Target.TRITON, (9, 0), True, MhcPath.TILELANG),  # sm_90+ with tilelang: vLLM's own
    ("auto", Target.TRITON, (9, 0), True, MhcPath.TILELANG),
    ("torch", Target.TRITON, (9, 0), True, MhcPath.TORCH),
    (" Triton ", Target.TRITON, (9, 0), True, MhcPath.TRITON),
    ("tilelang", Target.TRITON, (8, 9), True, MhcPath.TILELANG),  # an operator's choice
])
def test_decide_mhc_path(raw, target, cap, tilelang, expected):
    path, why = decide_mhc_path(raw, target, cap, tilelang)
    assert path is expected and why


def test_decide_mhc_path_refuses_bad_values():
    with pytest.raises(ValueError, match="GLMCTL_MHC='fast' is not one of"):
        decide_mhc_path("fast", Target.TRITON, (8, 9), True)
    with pytest.raises(ValueError, match="tilelang is not importable"):
        decide_mhc_path("tilelang", Target.TRITON, (8, 9), False)


def test_kpool_indexer_alignment_is_a_multiple_of_both_rules():
    from glmctl.kernels.layouts import kpool_indexer_alignment

    assert kpool_indexer_alignment(16, 128, 0, 512) == 1024  # CUDA, no drafts: the tail ring needs 1,024
    assert kpool_indexer_alignment(16, 128, 3, 512) == 1536  # MTP-3: 18-slot ring
    assert kpool_indexer_alignment(16, 128, 3, None) == 1536  # vLLM CPU has no multiple of its own
    assert kpool_indexer_alignment(16, 128, 3, 1024) == 3072  # sm_120's 64 x kpool: the lcm
