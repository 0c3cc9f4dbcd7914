"""Multi-device runs: batch across a `data` axis, KV heads across a `model` axis.

`--mesh data=D,model=M` (CLI) and `mesh=` (`kvjax.load`, `generate`, `compress`,
`engine.run`) name a (data, model) mesh of D * M devices. What is sharded:

- weights (`param_shardings`): the columns of q, k, v (and their biases) and the rows of
  `o` by head, gate/up/down by the MLP width, over `model`; embeddings and norms
  replicated. `kvjax.load(..., mesh=)` reads each tensor's shard from the safetensors
  file straight onto its devices, so no device ever holds the whole model;
- the batch over `data` (`batch_sharding`); a batch that does not fill the axis is padded
  with copies of its last element, whose outputs are dropped (`pad_batch`);
- the KV cache [L, B, K, C, ...]: B over `data`, K over `model`.

The engine's programs are partitioned by XLA (GSPMD) from those placements, so the
single-device code is the multi-device code. The compression step is the exception: with
`model` > 1 and a method whose prefill hook works on a block of heads
(`Method.splits_heads`: the SnapKV family, AdaKV, H2O, LAVa, CAKE), the engine runs the
hook per device in a `jax.shard_map` over `model` (`shard_heads`): each device scores
and selects for its own KV heads, and what spans heads goes through `LayerIO.heads`
(`kvjax.compression.heads`: sums as psums, the flattened top-k of AdaKV and LAVa as an
all-gather of each device's candidates), keeping the single-device entries, ties
included. Other methods (token selection, block pruning, TOVA's head mean, wrappers)
are partitioned by XLA.

Multi-host: call `jax.distributed.initialize()` first (one process per host, the same
script on every host); the mesh then spans every host's devices (`make_mesh` refuses one
that would leave a process out), and what the driver reads back to the host is gathered
from every process first (`to_host`). Tested with two processes on one machine
(tests/test_multidevice.py); README, "Multi-host".
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.compression.heads import Heads
from kvjax.config import ModelConfig

AXES = ("data", "model")
HEAD_AXIS = "model"
# which axis of each stacked layer weight holds the heads / the MLP width
_MODEL_AXIS = {"q": 2, "k": 2, "v": 2, "o": 1, "q_bias": 1, "k_bias": 1, "v_bias": 1,
               "gate": 2, "up": 2, "down": 1}
_MESH_TEXT = re.compile(r"^\s*data\s*=\s*(\d+)\s*,\s*model\s*=\s*(\d+)\s*$")


def parse_mesh(text: str) -> tuple[int, int]:
    """"data=D,model=M" -> (D, M), both >= 1; anything else is a ValueError that says the
    form (the CLI's `--mesh`)."""
    m = _MESH_TEXT.match(text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"mesh {text!r} is not of the form data=D,model=M with D, M >= 1 "
                         "(e.g. data=4,model=2)")
    return int(m[1]), int(m[2])


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: the first data * model devices, all
    of them when `data` is None: data = the rest)."""
    if devices is None and data is not None:
        devices = jax.devices()
        if data * model > len(devices):
            raise ValueError(f"mesh data={data},model={model} needs {data * model} devices; "
                             f"{len(devices)} {jax.default_backend()} device(s) available")
        if jax.process_count() > 1 and data * model != len(devices):
            # the first D * M devices could leave a process out: it then holds no shard
            raise ValueError(f"mesh data={data},model={model}: a multi-process mesh spans "
                             f"every process's devices, {len(devices)} here (pass devices= "
                             "for another layout)")
        devices = devices[: data * model]
    devices = list(jax.devices() if devices is None else devices)
    data = len(devices) // model if data is None else data
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} does not cover {len(devices)} devices")
    return Mesh(np.array(devices).reshape(data, model), AXES,
                axis_types=(AxisType.Auto, AxisType.Auto))


def check_mesh(mesh: Mesh, cfg: ModelConfig) -> None:
    """Refuse, naming the values, a mesh the model cannot be split over: the axes must be
    (data, model), and `model` must divide the KV heads (a device holds whole heads) and
    the MLP width."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"a kvjax mesh has the axes {AXES}, got {tuple(mesh.axis_names)} "
                         "(build one with kvjax.distributed.make_mesh)")
    m = mesh.shape["model"]
    if cfg.num_kv_heads % m or cfg.intermediate_size % m:
        raise ValueError(f"mesh model={m} must divide the model's num_kv_heads="
                         f"{cfg.num_kv_heads} and intermediate_size={cfg.intermediate_size}")


def as_mesh(mesh, cfg: ModelConfig | None = None) -> Mesh | None:
    """A `Mesh` from a Mesh, a "data=D,model=M" string (the first D * M devices) or None
    (None: one device, no mesh), checked against the model when `cfg` is given."""
    if mesh is None:
        return None
    if isinstance(mesh, str):
        mesh = make_mesh(*parse_mesh(mesh))
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a 'data=D,model=M' string, got "
                        f"{type(mesh).__name__}")
    if cfg is not None:
        check_mesh(mesh, cfg)
    if any(t != AxisType.Auto for t in getattr(mesh, "axis_types", ())):
        # `jax.make_mesh` gives Explicit axes, whose programs must name every output's
        # sharding; kvjax's programs leave that to XLA (Auto), on the same devices
        mesh = Mesh(mesh.devices, tuple(mesh.axis_names),
                    axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return mesh


def to_host(x) -> np.ndarray:
    """`x` whole on the host. In a multi-process run an array sharded over other processes'
    devices is gathered first (every process receives the whole array)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def describe(mesh: Mesh | None) -> dict | None:
    """{"data": D, "model": M} (what records say), None without a mesh."""
    return None if mesh is None else {a: int(mesh.shape[a]) for a in AXES}


# ---- weights ------------------------------------------------------------------------------


def _spec(name: str, ndim: int, m: int) -> P:
    axis = _MODEL_AXIS.get(name)
    if axis is None or m == 1:
        return P()
    return P(*[("model" if i == axis else None) for i in range(ndim)])


PER_LAYER_ON_MESH = ("layer storage 'per_layer' is for a model on one device (the shardings "
                     "are of the stacked [L, ...] weights); allowed on a mesh: 'stacked' "
                     "(Model.with_layers('stacked'))")


def param_specs(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """PartitionSpecs: head-carrying weights split over `model` (which must divide the KV
    heads and the MLP width), the rest replicated. `params`: arrays or their shapes."""
    check_mesh(mesh, cfg)
    if isinstance(params["layers"], (tuple, list)):
        raise ValueError(PER_LAYER_ON_MESH)
    m = mesh.shape["model"]
    out = {k: P() for k in params if k != "layers"}
    ndim = lambda v: len(v) if isinstance(v, tuple) else np.ndim(v)  # noqa: E731 (a shape)
    out["layers"] = {k: _spec(k, ndim(v), m) for k, v in params["layers"].items()}
    return out


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """`NamedSharding`s of every parameter the config implies (the tree of
    `kvjax.models.checkpoint.param_shapes`): what a sharded load places each tensor with."""
    from kvjax.models.checkpoint import param_shapes

    shapes = param_shapes(cfg)
    specs = param_specs(shapes, cfg, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Params placed on the mesh (a no-op for arrays already placed so)."""
    specs = param_specs(params, cfg, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs,
                        is_leaf=lambda x: isinstance(x, P))


# ---- inputs -------------------------------------------------------------------------------


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token arrays [B, T]: batch over `data`."""
    return NamedSharding(mesh, P("data", None))


def pad_batch(prompts: list, questions: list | None, data: int):
    """The batch padded to a multiple of the `data` axis with copies of its last element
    (and question): a copy is a prompt the method was checked on, of a length the bucket
    already holds, so it adds no shape and no failure; the engine drops its outputs.
    Returns (prompts, questions)."""
    extra = -len(prompts) % data
    if not extra:
        return prompts, questions
    prompts = list(prompts) + [prompts[-1]] * extra
    if questions is not None:
        questions = list(questions) + [questions[-1]] * extra
    return prompts, questions


# ---- the compression step per device --------------------------------------------------------


def head_mesh(mesh: Mesh | None, method) -> Mesh | None:
    """The mesh the compression step runs per device on (`shard_heads`), or None: no mesh,
    one device per model replica (`model` = 1), or a method whose prefill hook is not
    head-local (XLA partitions those)."""
    if mesh is None or mesh.shape[HEAD_AXIS] == 1:
        return None
    if method.prefill_kind != "scan" or not method.splits_heads():
        return None
    return mesh


def head_block(cfg: ModelConfig, m: int) -> ModelConfig:
    """The config one device's block of heads looks like (shapes only)."""
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // m,
                               num_heads=cfg.num_heads // m)


def _io_specs(io):
    """PartitionSpecs of a prefill `LayerIO`: query heads, KV heads and W_O's rows over
    `model`; the layer index, positions and hidden states replicated."""
    qh = P(None, None, HEAD_AXIS, None)
    kv = P(None, HEAD_AXIS, None, None)
    per = P(None, HEAD_AXIS, None)
    return dataclasses.replace(
        io, layer=P(), q=qh, k=kv, v=kv, pos=per, valid=per, qpos=P(), o=qh, hidden=P(),
        qvalid=None if io.qvalid is None else P(),
        wo=None if io.wo is None else P(HEAD_AXIS, None),
        lse=None if io.lse is None else P(None, HEAD_AXIS, None, None))


def _local(x, spec: P, m: int):
    """The abstract value one device holds of x under spec."""
    shape = [d // m if s == HEAD_AXIS else d for d, s in
             zip(x.shape, tuple(spec) + (None,) * (len(x.shape) - len(spec)))]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _head_spec(whole, block, m: int, what: str) -> P:
    """The spec of a value from its shape with all heads and with one device's block: the
    axis whose size changed is the head axis (none: replicated)."""
    changed = [a for a, (x, y) in enumerate(zip(whole.shape, block.shape)) if x != y]
    if (len(whole.shape) != len(block.shape) or len(changed) > 1
            or (changed and whole.shape[changed[0]] != block.shape[changed[0]] * m)):
        raise ValueError(f"cannot split {what} over the heads: shape {whole.shape} with all "
                         f"heads, {block.shape} with 1/{m} of them")
    return P(*[(HEAD_AXIS if a in changed else None) for a in range(len(whole.shape))])


def _specs(whole, block, m: int, what: str):
    return jax.tree.map(lambda w, b: _head_spec(w, b, m, what), whole, block)


def shard_heads(hook, mesh: Mesh, method, cfg: ModelConfig, batch: int, length: int):
    """The prefill's per-layer hook `(io, state) -> ((kv, aux), state)` run per device in a
    `jax.shard_map` over `model`: each device sees its own KV heads (and their query
    heads and W_O rows), with `io.heads` naming the axis for what spans heads.

    Which axis of the method's state and outputs holds the heads is read from their
    shapes: the state from `init_state` with every head and with one device's block
    (`head_block`), the outputs from the hook traced both ways (abstractly); an axis whose
    size changed is split, anything else replicated. `data` stays with XLA (`axis_names`
    names `model` only), so the batch keeps its sharding inside. `check_vma=False`:
    `all_gather`'s result is typed as varying in jax 0.10 although every device holds the
    same, so the replicated outputs (LAVa's layer budgets) cannot be proven invariant;
    equality with one device is what the tests check instead."""
    m = mesh.shape[HEAD_AXIS]
    local_cfg = head_block(cfg, m)
    st_whole = jax.eval_shape(lambda: method.init_state(cfg, batch, length))
    st_block = jax.eval_shape(lambda: method.init_state(local_cfg, batch, length))
    st_specs = _specs(st_whole, st_block, m, f"{method.name}'s prefill state")

    def run(io, st):
        io_specs = _io_specs(io)
        io_whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), io)
        io_block = jax.tree.map(lambda x, s: _local(x, s, m), io_whole, io_specs)
        out_whole = jax.eval_shape(hook, io_whole, st_whole)
        out_block = jax.eval_shape(hook, io_block, st_block)
        out_specs = _specs(out_whole, out_block, m, f"{method.name}'s prefill hook output")
        if jax.tree.structure(out_specs[1]) != jax.tree.structure(st_specs) or any(
                a != b for a, b in zip(jax.tree.leaves(out_specs[1]), jax.tree.leaves(st_specs))):
            raise ValueError(f"{method.name}'s prefill state changes its head axis in the hook")

        def block(io, st):
            return hook(dataclasses.replace(io, heads=Heads(HEAD_AXIS)), st)

        return jax.shard_map(block, mesh=mesh, in_specs=(io_specs, st_specs),
                             out_specs=out_specs, axis_names=frozenset({HEAD_AXIS}),
                             check_vma=False)(io, st)

    return run
