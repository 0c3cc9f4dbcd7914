"""Rotary position embeddings (HF `rotate_half` layout), incl. Llama 3 frequency scaling."""

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
    if cfg.rope_scaling is None:
        return freq.astype(np.float32)
    kind, factor, low, high, orig = cfg.rope_scaling
    if kind == "linear":
        return (freq / factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = f32(2 * math.pi) / freq
    smooth = (f32(orig) / wavelen - f32(low)) / f32(high - low)
    scaled = np.where(wavelen > low_wavelen, freq / f32(factor), freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * scaled / f32(factor) + smooth * scaled, scaled)
    return scaled.astype(np.float32)


def apply_rope(
    x_BTHD: Float[Array, "B T H D"], pos_BT: Int[Array, "B T"], freq: np.ndarray
) -> Float[Array, "B T H D"]:
    """Rotate pairs (i, i + D/2) by pos * freq, in float32 like HF."""
    ang_BTF = pos_BT[..., None].astype(jnp.float32) * jnp.asarray(freq)
    cos = jnp.cos(jnp.concatenate([ang_BTF, ang_BTF], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([ang_BTF, ang_BTF], -1))[:, :, None, :]
    xf = x_BTHD.astype(jnp.float32)
    half = x_BTHD.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rot * sin).astype(x_BTHD.dtype)
