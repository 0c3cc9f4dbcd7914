"""HF eager attention over a reference KV cache, for the step-by-step references of the
decode-time methods (D2O, RoCo, CaM): the prompt's attentions and keys/values from HF, then
one decoding token at a time through the HF layers with each layer's cache replaced by the
reference's (numpy) contents, so a reference can evict / merge with plain numpy between
steps and still get the model's own attention of the next token.

Llama-family HF models only (model.model.{embed_tokens, rotary_emb, layers}).
"""

from __future__ import annotations

import numpy as np
import torch


def prefill(model, ids: list[int]):
    """HF eager prefill -> (attn [L, H, n, n], keys [L, Kh, n, D], values [L, Kh, n, D]);
    keys are RoPE'd, as cached."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    attn = np.stack([a[0].float().numpy() for a in out.attentions])
    pkv = out.past_key_values
    ks = np.stack([pkv.layers[l].keys[0].numpy() for l in range(len(attn))])
    vs = np.stack([pkv.layers[l].values[0].numpy() for l in range(len(attn))])
    return attn, ks, vs


class _LayerCache:
    """Duck-typed HF cache: `update` appends the new key/value to one layer's reference
    contents and remembers them (HF's attention calls it, then attends to the result)."""

    def __init__(self, k_KSD: np.ndarray, v_KSD: np.ndarray):
        self.k = torch.from_numpy(np.ascontiguousarray(k_KSD, np.float32))[None]
        self.v = torch.from_numpy(np.ascontiguousarray(v_KSD, np.float32))[None]
        self.new = None

    def update(self, k, v, layer_idx, cache_kwargs=None):
        self.new = (k[0, :, 0].numpy().copy(), v[0, :, 0].numpy().copy())
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)


def step(model, token: int, position: int, caches: list[tuple[np.ndarray, np.ndarray]]):
    """One decoding token at `position` over per-layer caches (k [Kh, S_l, D], v): for every
    layer, (attention of the token [H, S_l + 1] -- the cached entries in the given order,
    then itself --, its key [Kh, D] (RoPE'd), its value [Kh, D]). No mask: a decoding token
    sees every cached entry and itself."""
    m = model.model
    out = []
    with torch.no_grad():
        x = m.embed_tokens(torch.tensor([[token]]))
        pe = m.rotary_emb(x, torch.tensor([[position]]))
        for layer, (k, v) in zip(m.layers, caches):
            cache = _LayerCache(k, v)
            h = layer.input_layernorm(x)
            o, w = layer.self_attn(hidden_states=h, position_embeddings=pe, attention_mask=None,
                                   past_key_values=cache)
            x = x + o
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append((w[0, :, 0].float().numpy(), *cache.new))
    return out
