"""GGUF files written by the tests, laid out as llama.cpp's `convert_hf_to_gguf.py` lays
them out (nothing is downloaded): metadata under the architecture's keys, 1-D tensors in
F32, the rows of a `llama` model's `attn_q` / `attn_k` permuted for llama.cpp's rope,
Llama 3's rope scaling as a `rope_freqs` tensor, and the tokenizer as `tokenizer.ggml.*`
(tokens in id order, merges, token types, pre-tokenizer name, special ids, add-BOS flag,
chat template)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_NAMES = {  # HF suffix -> GGUF name in blk.N.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (rotate-half halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def llama3_factors(cfg) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a llama3 rope scaling."""
    rs = cfg.rope_scaling
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# type -> (byte offsets of its float16 scales: d, then dmin / m where it has one; the
# largest |scale * code| of a weight): what `random_blocks` sets to make weights of a size
SCALES = {"Q8_0": ((0,), 127), "Q4_0": ((0,), 8), "Q4_1": ((0, 2), 15), "Q5_0": ((0,), 16),
          "Q5_1": ((0, 2), 31), "Q2_K": ((80, 82), 45), "Q3_K": ((108,), 128),
          "Q4_K": ((0, 2), 945), "Q5_K": ((0, 2), 1953), "Q6_K": ((208,), 4096)}


def random_blocks(rows: int, cols: int, qtype: str, size: float, seed: int = 0) -> np.ndarray:
    """The bytes of a `rows x cols` tensor of type `qtype` (`SCALES`), as the writer takes
    them (`[rows, bytes a row]`): random codes, random finite scales that make the weights
    at most about `size` (gguf has no quantizer for the K-quants, so a test's K-quant
    weights are these, not a quantized model's)."""
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    at, top = SCALES[qtype]
    d = (size / top * rng.uniform(0.5, 1.0, len(b))).astype(np.float16)
    b[:, at[0]:at[0] + 2] = d.view(np.uint8).reshape(-1, 2)
    if len(at) > 1:  # a minimum near the middle of the codes' range
        m = np.asarray(-size / 2 if qtype in ("Q4_1", "Q5_1") else d * 8, np.float16)
        b[:, at[1]:at[1] + 2] = np.resize(m, len(b)).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def _add(w: gguf.GGUFWriter, name: str, x: np.ndarray, qtype: str | dict) -> None:
    if isinstance(qtype, dict):  # a mix: the first suffix that matches, else ""
        qtype = next((t for k, t in qtype.items() if k and name.endswith(k)), qtype[""])
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms, biases, rope_freqs in F32
        w.add_tensor(name, x)
        return
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F16":
        w.add_tensor(name, x.astype(np.float16))
    elif qtype.endswith("_K"):  # random blocks of the weights' size (`random_blocks`)
        seed = sum(name.encode())
        w.add_tensor(name, random_blocks(*x.shape, qtype, 3 * float(x.std()), seed),
                     raw_dtype=t)
    else:  # the bytes of the blocks; the writer derives the shape from the type
        w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)


def add_tokenizer(w: gguf.GGUFWriter, tok_dir: Path, pre: str) -> None:
    """`tokenizer.ggml.*` from an HF tokenizer directory, as the converter's
    `_set_vocab_gpt2` writes them."""
    raw = json.loads((tok_dir / "tokenizer.json").read_text())
    conf = json.loads((tok_dir / "tokenizer_config.json").read_text())
    vocab = dict(raw["model"]["vocab"])
    added = {t["content"]: t for t in raw["added_tokens"]}
    vocab.update({c: t["id"] for c, t in added.items()})
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    types = [(gguf.TokenType.CONTROL if added[t]["special"] else gguf.TokenType.USER_DEFINED)
             if t in added else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("pad_token", w.add_pad_token_id)):
        if conf.get(key):
            add(vocab[conf[key]])
    post = json.dumps(raw.get("post_processor"))
    w.add_add_bos_token(conf.get("bos_token") is not None and conf["bos_token"] in post)
    if conf.get("chat_template"):
        w.add_chat_template(conf["chat_template"])


def write(path: str | Path, model=None, qtype: str | dict = "F32", tok_dir: Path | None = None,
          pre: str | None = None, head_dim_key: bool = True) -> Path:
    """A GGUF file of an HF torch model (`tests/hf_models.build`) and/or a tokenizer.
    qtype: the weights' type, or {GGUF name suffix: type} with a "" default (a mix, as
    llama.cpp's Q4_K_M: {"": "Q4_K", "ffn_down.weight": "Q6_K", "token_embd.weight":
    "Q5_0"})."""

    path = Path(path)
    cfg = model.config if model is not None else None
    arch = ARCH[cfg.model_type] if cfg is not None else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"kvjax test {arch}")
    if cfg is not None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        w.add_rope_freq_base(theta)
        w.add_vocab_size(cfg.vocab_size)
        if head_dim_key:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch == "llama":
            w.add_rope_dimension_count(head_dim)
        sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        _add(w, "token_embd.weight", sd["model.embed_tokens.weight"], qtype)
        _add(w, "output_norm.weight", sd["model.norm.weight"], qtype)
        if not cfg.tie_word_embeddings:
            _add(w, "output.weight", sd["lm_head.weight"], qtype)
        rs = getattr(cfg, "rope_scaling", None)
        if rs and rs.get("rope_type") == "llama3":
            cfg.head_dim = head_dim
            cfg.rope_theta = theta
            _add(w, "rope_freqs.weight", llama3_factors(cfg), "F32")
        for i in range(cfg.num_hidden_layers):
            for hf, gg in _NAMES.items():
                x = sd.get(f"model.layers.{i}.{hf}")
                if x is None:
                    continue
                if arch == "llama" and gg in ("attn_q.weight", "attn_k.weight"):
                    x = permute(x, cfg.num_attention_heads if gg == "attn_q.weight"
                                else cfg.num_key_value_heads)
                _add(w, f"blk.{i}.{gg}", x, qtype)
    if tok_dir is not None:
        add_tokenizer(w, Path(tok_dir), pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
