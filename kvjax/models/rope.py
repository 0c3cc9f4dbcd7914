"""Rotary position embeddings (HF `rotate_half` layout), incl. the linear, Llama 3 and YaRN
frequency scalings, each computed as transformers' `ROPE_INIT_FUNCTIONS` computes it."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [D/2], computed once on the host in float32 as HF does
    (a float64 table differs by ~1e-7 relative, i.e. ~1e-4 rad at position 2048)."""
    d = cfg.head_dim
    f32 = np.float32
    freq = f32(1.0) / (f32(cfg.rope_theta) ** (np.arange(0, d, 2).astype(f32) / f32(d)))
    rs = cfg.rope_scaling
    if rs is None:
        return freq.astype(np.float32)
    if rs.rope_type == "linear":
        return (freq / f32(rs.factor)).astype(np.float32)
    if rs.rope_type == "yarn":
        return _yarn(d, cfg.rope_theta, rs)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between
    factor, low, high = rs.factor, rs.low_freq_factor, rs.high_freq_factor
    orig = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = f32(2 * math.pi) / freq
    smooth = (f32(orig) / wavelen - f32(low)) / f32(high - low)
    scaled = np.where(wavelen > low_wavelen, freq / f32(factor), freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * scaled / f32(factor) + smooth * scaled, scaled)
    return scaled.astype(np.float32)


def _yarn(d: int, base: float, rs) -> np.ndarray:
    """YaRN (Peng et al. 2023, as `transformers.modeling_rope_utils._compute_yarn_parameters`):
    pairs that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those turning more than `beta_fast` times kept, a linear ramp over
    the pair index between. The bounds are computed in float64 and the table in float32, as
    HF does."""
    f32 = np.float32
    orig = rs.original_max_position_embeddings

    def pair_of(rotations: float) -> float:  # the pair index turning `rotations` times
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(rs.beta_fast), pair_of(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    keep = (f32(1) - ramp).astype(f32)  # 1: extrapolated (the original frequency)
    pos = f32(base) ** (np.arange(0, d, 2).astype(f32) / f32(d))
    extrapolated, interpolated = f32(1.0) / pos, f32(1.0) / (f32(rs.factor) * pos)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def attention_scaling(cfg: ModelConfig) -> float:
    """The factor HF multiplies cos and sin by (so q.k by its square): YaRN's mscale, 1.0
    for every other RoPE."""
    rs = cfg.rope_scaling
    return rs.attention_factor if rs is not None and rs.rope_type == "yarn" else 1.0


def apply_rope(
    x_BTHD: Float[Array, "B T H D"], pos_BT: Int[Array, "B T"], freq: np.ndarray,
    scale: float = 1.0,
) -> Float[Array, "B T H D"]:
    """Rotate pairs (i, i + D/2) by pos * freq, in float32 like HF; `scale`
    (`attention_scaling`) multiplies cos and sin, as HF's rotary embedding does."""
    ang_BTF = pos_BT[..., None].astype(jnp.float32) * jnp.asarray(freq)
    cos = jnp.cos(jnp.concatenate([ang_BTF, ang_BTF], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([ang_BTF, ang_BTF], -1))[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x_BTHD.astype(jnp.float32)
    half = x_BTHD.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rot * sin).astype(x_BTHD.dtype)
