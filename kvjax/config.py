"""Model configuration: one frozen dataclass for every supported family.

Frozen and hashable so that it is a static argument of `jit`: shapes and branches that
depend on it are resolved at trace time, never at run time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # (type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head, before RoPE
    sliding_window: int | None = None  # Mistral v0.1
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_scaling is not None and self.rope_scaling[0] not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {self.rope_scaling[0]!r}; supported: {ROPE_TYPES}"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- HF config.json <-> ModelConfig -------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type")
        family = {v: k for k, v in _HF_MODEL_TYPES.items()}.get(model_type)
        if family is None:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={hf.get('architectures')}); supported: {sorted(_HF_MODEL_TYPES.values())}"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        sliding = hf.get("sliding_window") if family == "mistral" else None
        if family == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 use_sliding_window=True is not supported")
        if family != "qwen2" and hf.get("attention_bias"):
            raise ValueError(f"attention_bias=True is not supported for model_type={model_type!r}")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act={hf['hidden_act']!r}; supported: 'silu'")
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=hf.get("pad_token_id") or 0,
        )

    def to_hf(self) -> dict[str, Any]:
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.family]
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": _HF_MODEL_TYPES[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            kind, factor, low, high, orig = self.rope_scaling
            scaling = {"rope_type": kind, "factor": factor}
            if kind == "llama3":
                scaling.update(low_freq_factor=low, high_freq_factor=high,
                               original_max_position_embeddings=orig)
            out["rope_scaling"] = scaling
        if self.family == "mistral":
            out["sliding_window"] = self.sliding_window
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))


def _rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(hf: dict[str, Any]) -> tuple | None:
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")
    return (
        kind,
        float(rs["factor"]),
        float(rs.get("low_freq_factor", 1.0)),
        float(rs.get("high_freq_factor", 4.0)),
        int(rs.get("original_max_position_embeddings", 8192)),
    )
