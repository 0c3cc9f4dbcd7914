"""GGUF files (llama.cpp's format) -> (config, params), read as transformers reads them.

docs/gguf.md says what is supported and why. In short:
- architectures `llama` (Llama 2/3, Mistral, SmolLM2), `qwen2`, `qwen3`;
- tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K,
  Q8_K, dequantized on load (`kvjax.models.quants`, bit for bit the `gguf` package's
  reference) to the requested dtype;
- llama.cpp's converter permutes the rows of a `llama` model's `attn_q` / `attn_k` so that
  its rope rotates adjacent pairs; they are permuted back to HF's rotate-half layout, as
  transformers' `LlamaTensorProcessor` does (qwen2 / qwen3 are converted unpermuted);
- Llama 3.1's `rope_freqs` tensor is matched to the llama3 rope scaling it was made from.
The tokenizer is `kvjax.tokenization.from_gguf`. Anything else is one error naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig, RopeScaling
from kvjax.models import gguf_reader, quants
from kvjax.models.checkpoint import assemble, tensor_names
from kvjax.models.transformer import Params

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF -> family
TENSOR_TYPES = quants.TYPES

# our layer name -> (GGUF name in blk.N., transpose to our [in, out] layout)
_LAYER = {
    "attn_norm": ("attn_norm.weight", False),
    "q": ("attn_q.weight", True), "k": ("attn_k.weight", True),
    "v": ("attn_v.weight", True), "o": ("attn_output.weight", True),
    "q_bias": ("attn_q.bias", False), "k_bias": ("attn_k.bias", False),
    "v_bias": ("attn_v.bias", False),
    "q_norm": ("attn_q_norm.weight", False), "k_norm": ("attn_k_norm.weight", False),
    "mlp_norm": ("ffn_norm.weight", False),
    "gate": ("ffn_gate.weight", True), "up": ("ffn_up.weight", True),
    "down": ("ffn_down.weight", True),
}


def is_gguf(path: str | Path) -> bool:
    """A file whose first four bytes are GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def reader(path: str | Path) -> gguf_reader.File:
    """The file's metadata and tensor table (`kvjax.models.gguf_reader`), or one error
    naming the file."""
    try:
        return gguf_reader.read(path)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 -- a bad string, an unreadable file, ...
        raise ValueError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") \
            from None


def field(r: gguf_reader.File, key: str, default=None):
    """A metadata value (a str, a number, or a list of them); `default` when absent."""
    return r.fields.get(key, default)


def _need(r, key: str, path) -> object:
    v = field(r, key)
    if v is None:
        raise ValueError(f"{path}: metadata {key!r} is missing")
    return v


def config(r, path) -> ModelConfig:
    """The model config from the file's metadata, named as llama.cpp writes it."""
    arch = field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    a = lambda k, d=None: field(r, f"{arch}.{k}", d)  # noqa: E731
    heads = int(_need(r, f"{arch}.attention.head_count", path))
    kv = a("attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer counts: supported only when all equal
        if len(set(kv)) != 1:
            raise ValueError(f"{path}: per-layer KV head counts {sorted(set(kv))} are not "
                             "supported (one count for every layer)")
        kv = kv[0]
    hidden = int(_need(r, f"{arch}.embedding_length", path))
    head_dim = int(a("attention.key_length", hidden // heads))
    rot = a("rope.dimension_count", head_dim)
    if int(rot) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count={rot}, "
                         f"head_dim={head_dim}) are not supported")
    tokens = field(r, "tokenizer.ggml.tokens")
    vocab = a("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        vocab = _tensor(r, "token_embd.weight", path).shape[-1]  # GGUF order: [hidden, vocab]
    eos = [field(r, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    names = {t.name for t in r.tensors}
    return ModelConfig(
        family=ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_need(r, f"{arch}.feed_forward_length", path)),
        num_layers=int(_need(r, f"{arch}.block_count", path)),
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=head_dim,
        max_position_embeddings=int(a("context_length", 4096)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(r, arch, path),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=field(r, "tokenizer.ggml.bos_token_id"),
        # the stop set: llama.cpp stops at every end-of-generation id the file names
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        pad_token_id=int(field(r, "tokenizer.ggml.padding_token_id", 0) or 0),
    )


def _rope_scaling(r, arch: str, path) -> RopeScaling | None:
    kind = field(r, f"{arch}.rope.scaling.type")
    factor = field(r, f"{arch}.rope.scaling.factor")
    orig = field(r, f"{arch}.rope.scaling.original_context_length")
    if kind in (None, "none"):  # (a rope_freqs tensor is matched in `load`)
        return None
    if kind == "linear":
        return RopeScaling("linear", float(factor), int(orig or 0))
    if kind == "yarn":
        return RopeScaling("yarn", float(factor), int(orig))
    raise ValueError(f"{path}: rope scaling type {kind!r} is not supported; supported: "
                     "none, linear, yarn (and llama3 as a rope_freqs tensor)")


def _llama3_from_freqs(cfg: ModelConfig, factors: np.ndarray, path) -> ModelConfig:
    """The llama3 rope scaling whose per-pair frequency factors the converter stored as
    `rope_freqs` (llama.cpp divides each frequency by its factor; the file keeps no other
    trace of it). Its factor is the largest stored factor; low and high frequency factors 1
    and 4 (every Llama 3.x); the original length is searched over powers of two (Llama
    3.1 / 3.2: 8192). The table must match the stored one, else the file is refused."""
    from kvjax.models.rope import inv_freq

    want = inv_freq(dataclasses.replace(cfg, rope_scaling=None)) / factors.astype(np.float32)
    factor = float(np.max(factors))
    for orig in [8192] + [2 ** k for k in range(4, 21) if 2 ** k != 8192]:
        rs = RopeScaling("llama3", factor, orig, low_freq_factor=1.0, high_freq_factor=4.0)
        c = dataclasses.replace(cfg, rope_scaling=rs)
        if factor > 1 and np.allclose(inv_freq(c), want, rtol=1e-4, atol=0):
            return c
    raise ValueError(f"{path}: its rope_freqs tensor matches no llama3 rope scaling (factor "
                     f"{factor:g}, low 1, high 4, an original length a power of two); other "
                     "frequency factors are not supported")


def _tensor(r, name: str, path):
    for t in r.tensors:
        if t.name == name:
            return t
    raise ValueError(f"{path}: tensor {name!r} is missing")


def dequantize(t, path) -> np.ndarray:
    """A tensor as float32 in numpy's (rows, columns) order, i.e. GGUF's shape reversed:
    HF's [out, in] for a linear layer."""
    if t.kind not in TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {t.name} has type {t.kind}; supported: "
                         f"{', '.join(TENSOR_TYPES)}")
    return quants.dequantize(t.data, t.kind, t.n_elements).reshape(t.shape[::-1])


def unpermute(w_OI: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a q or k projection (rows [heads * Dh, in]): its rows
    were reordered per head from HF's rotate-half halves to interleaved pairs."""
    dim = w_OI.shape[0] // heads // 2
    return w_OI.reshape(heads, dim, 2, *w_OI.shape[1:]).swapaxes(2, 1).reshape(w_OI.shape)


def load(path: str | Path, dtype=jnp.float32, shardings=None, r=None
         ) -> tuple[ModelConfig, Params]:
    """(config, params) of a GGUF file: every tensor the config implies must be there with
    the shape it implies, and no other (but `rope_freqs`). `r`: the file's `reader`, when
    the caller has one (the tokenizer reads the same metadata)."""
    path = Path(path)
    r = reader(path) if r is None else r
    cfg = config(r, path)
    by_name = {t.name: t for t in r.tensors}
    if "rope_freqs.weight" in by_name:
        cfg = _llama3_from_freqs(cfg, dequantize(by_name["rope_freqs.weight"], path), path)
    expected = tensor_names(cfg, {"embed": "token_embd.weight", "final_norm":
                                  "output_norm.weight", "lm_head": "output.weight"},
                            _LAYER, "blk.{i}.{name}")
    missing = sorted(set(expected) - set(by_name))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{path} is missing tensors: {missing[:5]}{more}")
    unexpected = sorted(set(by_name) - set(expected) - {"rope_freqs.weight"})
    if unexpected:
        raise ValueError(f"{path} has tensors this config does not use: {unexpected[:5]}")
    permute = cfg.family == "llama"

    def tensors():
        for name, (ours, transpose) in expected.items():
            x = dequantize(by_name[name], path)
            if permute and name.endswith((".attn_q.weight", ".attn_k.weight")):
                x = unpermute(x, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
            yield name, ours, x, transpose

    params = assemble(tensors(), cfg, dtype, where=f"{path}: ")
    if shardings is not None:
        params = jax.device_put(params, shardings(cfg))
    return cfg, params
