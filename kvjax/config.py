"""Model configuration: one frozen dataclass for every supported family.

Frozen and hashable so that it is a static argument of `jit`: shapes and branches that
depend on it are resolved at trace time, never at run time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF's `rope_scaling` (`rope_parameters` in transformers 5) with every default filled
    in as transformers fills it, so `models.rope` computes HF's frequencies and nothing is
    left to a second reading of the config. Frozen: part of the static `ModelConfig`."""

    rope_type: str  # linear | llama3 | yarn
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated pairs
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it (HF's mscale)
    truncate: bool = True  # yarn: the ramp's bounds rounded outward to whole pairs

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r}; supported: "
                             f"{ROPE_TYPES}")


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
    rope_scaling: RopeScaling | None = None  # a dict or the older tuple
    # (type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    # is converted
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head, before RoPE
    sliding_window: int | None = None  # Mistral v0.1; Qwen2/Qwen3 use_sliding_window
    # the layers that use `sliding_window` (Qwen2/Qwen3: layer_types, or the layers >=
    # max_window_layers); None: every layer (Mistral)
    sliding_layers: tuple[int, ...] | None = None
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
        rs = self.rope_scaling
        if isinstance(rs, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**rs))
        elif isinstance(rs, (tuple, list)):  # the older (type, factor, low, high, orig)
            kind, factor, low, high, orig = rs
            object.__setattr__(self, "rope_scaling", RopeScaling(
                kind, float(factor), int(orig), low_freq_factor=float(low),
                high_freq_factor=float(high)))
        elif rs is not None and not isinstance(rs, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling, a dict or None, got {rs!r}")
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_layers is set but sliding_window is None")
            object.__setattr__(self, "sliding_layers", tuple(int(i) for i in
                                                             self.sliding_layers))

    def slides(self, layer: int) -> bool:
        """Whether `layer` attends inside `sliding_window` (a static layer number)."""
        return self.sliding_window is not None and (self.sliding_layers is None or
                                                    layer in self.sliding_layers)

    @property
    def max_positions(self) -> int:
        """The longest sequence (prompt + new tokens) the model takes: `max_position_embeddings`,
        or for yarn `factor * original_max_position_embeddings` when that is larger (Qwen2.5
        and Qwen3 turn yarn on for long context and leave max_position_embeddings at the
        original 32768; vLLM derives its limit the same way)."""
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "yarn":
            return max(self.max_position_embeddings,
                       int(rs.factor * rs.original_max_position_embeddings))
        return self.max_position_embeddings

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- HF config.json <-> ModelConfig -------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        if not isinstance(hf, dict):
            raise ValueError(f"a model config is a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        family = {v: k for k, v in _HF_MODEL_TYPES.items()}.get(model_type)
        if family is None:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={hf.get('architectures')}); supported: {sorted(_HF_MODEL_TYPES.values())}"
            )
        num_heads = _count(hf, "num_attention_heads")
        head_dim = _count(hf, "head_dim") if hf.get("head_dim") else \
            _count(hf, "hidden_size") // num_heads
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        sliding, sliding_layers = _sliding_window(hf, family, _count(hf, "num_hidden_layers"))
        if family != "qwen2" and hf.get("attention_bias"):
            raise ValueError(f"attention_bias=True is not supported for model_type={model_type!r}")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act={hf['hidden_act']!r}; supported: 'silu'")
        return cls(
            family=family,
            vocab_size=_count(hf, "vocab_size"),
            hidden_size=_count(hf, "hidden_size"),
            intermediate_size=_count(hf, "intermediate_size"),
            num_layers=_count(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_count(hf, "num_key_value_heads") if hf.get("num_key_value_heads")
            else num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            sliding_window=sliding,
            sliding_layers=sliding_layers,
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
        rs = self.rope_scaling
        if rs is not None:
            scaling = {"rope_type": rs.rope_type, "factor": rs.factor}
            if rs.rope_type in ("llama3", "yarn"):
                scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
            if rs.rope_type == "llama3":
                scaling.update(low_freq_factor=rs.low_freq_factor,
                               high_freq_factor=rs.high_freq_factor)
            if rs.rope_type == "yarn":
                scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                               attention_factor=rs.attention_factor, truncate=rs.truncate)
            out["rope_scaling"] = scaling
        if self.family == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = self.num_layers
            if self.sliding_window is not None:
                kinds = ["sliding_attention" if self.slides(i) else "full_attention"
                         for i in range(self.num_layers)]
                out["layer_types"] = kinds
                out["max_window_layers"] = kinds.index("sliding_attention")
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """The config of an HF config.json; any error names the file."""
        try:
            return cls.from_hf(json.loads(Path(path).read_text()))
        except ValueError as e:  # json.JSONDecodeError is one
            raise ValueError(f"{path}: {e}") from None


def _count(hf: dict[str, Any], key: str) -> int:
    """A required positive integer field of an HF config (a missing one is named, never a
    bare KeyError)."""
    if key not in hf:
        raise ValueError(f"config field {key!r} is missing (required for every model)")
    v = hf[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config field {key}={v!r} must be a positive integer")
    return v


def _rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 (`convert_rope_params_to_dict`): `rope_parameters["rope_theta"]`
    wins over the top-level field (which only fills it when absent); default 10000."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    """`rope_scaling` (or transformers 5's `rope_parameters`) with transformers' defaults:
    `original_max_position_embeddings` from the top level if there (Phi-3 style), else the
    rope dict's, else `max_position_embeddings` (`standardize_rope_params`); yarn's factor,
    betas and attention factor as `_compute_yarn_parameters` resolves them."""
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be a JSON object, got {rs!r}")
    if hf.get("layer_types") and set(rs) <= set(_LAYER_TYPES):
        raise ValueError(f"per-layer-type rope_parameters {sorted(rs)} are not supported")
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")
    partial = rs.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (RoPE on the "
                         "whole head only)")
    max_pos = hf.get("max_position_embeddings", 4096)
    orig = hf["original_max_position_embeddings"] if "original_max_position_embeddings" in hf \
        else rs.get("original_max_position_embeddings", max_pos)
    factor = rs.get("factor")
    if kind == "yarn" and factor is None:  # DeepSeek-V3 style: the ratio of the lengths
        factor = max_pos / orig
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ValueError(f"rope_scaling type {kind!r} needs a numeric 'factor', got "
                         f"{factor!r}")
    factor = float(factor)
    if kind != "yarn":
        return RopeScaling(kind, factor, int(orig),
                           low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling("yarn", factor, int(orig), beta_fast=float(rs.get("beta_fast") or 32),
                       beta_slow=float(rs.get("beta_slow") or 1),
                       attention_factor=float(attention),
                       truncate=bool(rs.get("truncate", True)))


def _sliding_window(hf: dict[str, Any], family: str, n_layers: int):
    """(sliding_window, sliding_layers) as transformers reads them. Mistral: one window for
    every layer. Qwen2/Qwen3: a window only with `use_sliding_window` (else HF sets
    `sliding_window` to None), on the layers `layer_types` marks "sliding_attention", which
    default to the layers >= `max_window_layers` (defaults 4096 and 28, HF's)."""
    if family == "mistral":
        return _window(hf.get("sliding_window")), None
    if family not in ("qwen2", "qwen3") or not hf.get("use_sliding_window"):
        return None, None
    window = _window(hf.get("sliding_window", 4096))
    if window is None:
        return None, None
    kinds = hf.get("layer_types")
    if kinds is None:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"config field max_window_layers={first!r} must be an integer >= 0")
        kinds = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers or \
            any(k not in _LAYER_TYPES for k in kinds):
        raise ValueError(f"config field layer_types={kinds!r} must list one of {_LAYER_TYPES} "
                         f"for each of the {n_layers} layers")
    layers = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    if not layers:
        return None, None
    return window, None if len(layers) == n_layers else layers


def _window(w) -> int | None:
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"config field sliding_window={w!r} must be a positive integer or "
                         "null")
    return w
