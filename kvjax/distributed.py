"""Multi-device runs: batch across a `data` axis, KV heads across a `model` axis.

Parameters and inputs are placed with `NamedSharding`s and the engine's compiled programs
are partitioned by XLA (GSPMD) from those placements, so the single-device code is the
multi-device code: attention, scoring and per-head selection stay local to the device
that holds a head; a top-k across heads (AdaKV/LAVa flattened budgets) is partitioned by
XLA, which gathers the per-device candidates. Multi-host: call
`jax.distributed.initialize()` first; nothing here is host-specific.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.config import ModelConfig

# which axis of each stacked layer weight holds the heads / the MLP width
_MODEL_AXIS = {"q": 2, "k": 2, "v": 2, "o": 1, "q_bias": 1, "k_bias": 1, "v_bias": 1,
               "gate": 2, "up": 2, "down": 1}


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all), data = the rest when None."""
    devices = list(jax.devices() if devices is None else devices)
    data = len(devices) // model if data is None else data
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} does not cover {len(devices)} devices")
    return Mesh(np.array(devices).reshape(data, model), ("data", "model"),
                axis_types=(AxisType.Auto, AxisType.Auto))


def param_specs(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """PartitionSpecs: head-carrying weights split over `model` when the KV heads divide."""
    m = mesh.shape["model"]
    if cfg.num_kv_heads % m or cfg.intermediate_size % m:
        raise ValueError(f"model axis {m} must divide num_kv_heads={cfg.num_kv_heads} and "
                         f"intermediate_size={cfg.intermediate_size}")

    def spec(name, x):
        axis = _MODEL_AXIS.get(name)
        if axis is None or m == 1:
            return P()
        return P(*[("model" if i == axis else None) for i in range(x.ndim)])

    out = {k: P() for k in params if k != "layers"}
    out["layers"] = {k: spec(k, v) for k, v in params["layers"].items()}
    return out


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    specs = param_specs(params, cfg, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token arrays [B, T]: batch over `data`."""
    return NamedSharding(mesh, P("data", None))
