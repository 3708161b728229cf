"""A tiny random Llama checkpoint (test fixture): what vLLM CPU serves with no plugin help.

Used by the vllm lane to exercise glmctl's launch and supervision on a real `vllm serve` while the
tiny GLM-5.3-Flash checkpoint cannot be served on CPU yet. Same tokenizer as the tiny GLM
(glmctl.testing.tiny_tokenizer); sizes chosen so vLLM's CPU attention accepts them (head dim 64).
"""

from __future__ import annotations

from pathlib import Path

MAX_POSITIONS = 8192  # as the tiny GLM checkpoint, so the tiny-cpu profile's max_model_len fits


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from glmctl.testing.tiny_tokenizer import train_tokenizer

    tok = train_tokenizer(out_dir, vocab_size=512, model_max_length=MAX_POSITIONS)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir
