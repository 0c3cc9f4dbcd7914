"""Tiny random HF models built from configs in the tests (nothing is downloaded)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)

FAMILIES = {
    # name: (config class, model class, extra config)
    "llama_llama3rope_gqa4": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False)),
    "llama_mha_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2_bias_gqa2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "qwen3_qknorm_gqa2": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "mistral_gqa4": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, sliding_window=4096,
        tie_word_embeddings=False)),
}


def build(name: str, seed: int = 0, scale: float = 0.15, layers: int | None = None,
          **config):
    """A random fp32 eager-attention HF model whose weights are far from their init;
    `config` overrides fields of the family's config (rope_scaling, sliding window, ...).

    HF's init (std 0.02, unit norms, zero biases) gives near-uniform attention and tiny
    logits, which would make a parity test easy to pass by accident; every tensor is
    redrawn so attention is peaked and logits are O(1).
    """
    cfg_cls, model_cls, extra = FAMILIES[name]
    kw = {**COMMON, **extra, **config}
    if layers is not None:
        kw["num_hidden_layers"] = layers
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in pname or "lm_head" in pname:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p) * (64 / p.shape[-1]) ** 0.5)
    return model


def build_pair(name: str, seed: int = 0, scale: float = 0.15, layers: int | None = None,
               **config):
    """(HF model, kvjax config, kvjax params) of the same random weights, via a save/load
    round trip of the HF checkpoint format."""
    from kvjax.models.checkpoint import load_hf

    model = build(name, seed, scale, layers, **config)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = load_hf(d)
    return model, cfg, params


def prefill_logits(model, cfg, params, T: int = 37, seed: int = 1):
    """(kvjax's, transformers') logits at every position of 2 random prompts of T tokens:
    the whole prompt through `prefill_layers` with no compression."""
    import jax.numpy as jnp
    import numpy as np

    from kvjax import engine
    from kvjax.engine import layers
    from kvjax.models import transformer

    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(2, T))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    valid = jnp.ones(ids.shape, bool)
    pos = engine.positions(valid, jnp.zeros(2, jnp.int32))
    x, _, _ = layers.prefill_layers(params, cfg, jnp.asarray(ids), valid, pos,
                                    lambda io, s: (None, s))
    return np.asarray(transformer.unembed(params, cfg, x)), ref
