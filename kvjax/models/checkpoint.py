"""HF checkpoint directories (config.json + *.safetensors, sharded or not) <-> params.

No network: a checkpoint is a local directory. Every tensor the config implies must be
there with the shape the config implies; anything else is an error that names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from kvjax.config import ModelConfig
from kvjax.models.transformer import Params

# our name -> (HF name pattern, transpose)
_LAYER = {
    "attn_norm": ("input_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "o": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
}
# buffers older exports carry that are recomputed here
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def param_shapes(cfg: ModelConfig) -> dict:
    """The exact parameter tree (as shapes) a config implies."""
    D, F, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, K, L = cfg.num_heads * Dh, cfg.num_kv_heads * Dh, cfg.num_layers
    layer = {"attn_norm": (D,), "q": (D, H), "k": (D, K), "v": (D, K), "o": (H, D),
             "mlp_norm": (D,), "gate": (D, F), "up": (D, F), "down": (F, D)}
    if cfg.qkv_bias:
        layer.update(q_bias=(H,), k_bias=(K,), v_bias=(K,))
    if cfg.qk_norm:
        layer.update(q_norm=(Dh,), k_norm=(Dh,))
    shapes = {"embed": (cfg.vocab_size, D), "final_norm": (D,),
              "layers": {n: (L, *s) for n, s in layer.items()}}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, cfg.vocab_size)
    return shapes


def tensor_names(cfg: ModelConfig, top: dict[str, str], layer: dict[str, tuple[str, bool]],
                 layer_format: str) -> dict[str, tuple[str, bool]]:
    """Flat map: a file's tensor name -> (our path 'layers/q/3' style, transpose), for every
    tensor the config implies. `top`: the file's names of embed, final_norm and lm_head;
    `layer`: our layer name -> (the file's, transpose); `layer_format`: "...{i}.{name}"."""
    names = {top["embed"]: ("embed", False), top["final_norm"]: ("final_norm", False)}
    if not cfg.tie_word_embeddings:
        names[top["lm_head"]] = ("lm_head", True)
    for ours in param_shapes(cfg)["layers"]:
        theirs, t = layer[ours]
        for i in range(cfg.num_layers):
            names[layer_format.format(i=i, name=theirs)] = (f"layers/{ours}/{i}", t)
    return names


def _hf_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    return tensor_names(cfg, {"embed": "model.embed_tokens.weight", "final_norm":
                              "model.norm.weight", "lm_head": "lm_head.weight"},
                        _LAYER, "model.layers.{i}.{name}")


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a 'weight_map' object): "
                             f"{type(e).__name__}: {e}") from None
        shards = {name: path / f for name, f in weight_map.items()}
        for f in sorted(set(shards.values())):
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index} is missing")
        return shards
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in checkpoint directory {path}")
    return {name: f for f in files for name in _header(f)[0]}


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def _header(f: Path) -> tuple[dict, int]:
    """(tensor name -> metadata, data start) of a safetensors file, checked against the
    file's size: a truncated or corrupt file is an error naming it, never a reshape error
    later."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(f"{f} is not a complete safetensors file: its header needs "
                             f"{8 + max(n, 0)} bytes, the file has {size}")
        try:
            meta = json.loads(fh.read(n))
        except ValueError as e:
            raise ValueError(f"{f} has a corrupt safetensors header: {e}") from None
    meta.pop("__metadata__", None)
    return meta, 8 + n


def _read(f: Path, name: str) -> np.ndarray:
    """One tensor, read straight from the file layout (safetensors' numpy reader has no bf16):
    `_mapped`, read into memory."""
    return np.array(_mapped(f, name))


def _mapped(f: Path, name: str) -> np.ndarray:
    """One tensor as a read-only memory map (a slice of it reads only its own bytes). Every
    size is checked, so a truncated file names itself and the tensor."""
    meta_all, start0 = _header(f)
    if name not in meta_all:
        raise ValueError(f"tensor {name} is not in {f} (its index says it is)")
    meta = meta_all[name]
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"tensor {name} in {f} has unsupported dtype {meta['dtype']}")
    start, stop = meta["data_offsets"]
    dtype = np.dtype(_DTYPES[meta["dtype"]])
    want = int(np.prod(meta["shape"], dtype=np.int64)) * dtype.itemsize
    if stop - start != want:
        raise ValueError(f"tensor {name} in {f}: shape {meta['shape']} of {meta['dtype']} "
                         f"needs {want} bytes, its offsets span {stop - start}")
    if start0 + stop > f.stat().st_size:
        raise ValueError(f"{f} is truncated: tensor {name} needs bytes {start0 + start}.."
                         f"{start0 + stop}, the file ends at {f.stat().st_size}")
    if not want:
        return np.zeros(meta["shape"], dtype)
    return np.memmap(f, dtype=dtype, mode="r", offset=start0 + start, shape=tuple(meta["shape"]))


def load_hf(path: str | Path, dtype=jnp.float32, shardings=None) -> tuple[ModelConfig, Params]:
    """Load a local HF checkpoint directory into (config, params).

    `shardings` (config -> a tree of `jax.sharding.Sharding` like the params, e.g.
    `kvjax.distributed.param_shardings`): each parameter is built shard by shard from
    memory maps of the files (`jax.make_array_from_callback`), so each device receives
    only its own slice and no device, nor the host, holds the whole model."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory: config.json is missing")
    cfg = ModelConfig.from_json(path / "config.json")
    eos = generation_eos(path)
    if eos:  # the stop set: generation_config.json's eos ids replace config.json's, as in
        # transformers' generate (its GenerationConfig is read from that file)
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(eos)))
    files = _tensor_files(path)
    expected = _hf_names(cfg)
    missing = sorted(set(expected) - set(files))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {missing[:5]}{more}")
    tied_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in set(files) - set(expected) - tied_extra
                        if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint {path} has tensors this config does not use: {unexpected[:5]}")

    if shardings is not None:
        return cfg, _load_sharded(files, expected, param_shapes(cfg), dtype, shardings(cfg))
    return cfg, assemble(((name, ours, _read(files[name], name), t)
                          for name, (ours, t) in expected.items()), cfg, dtype)


def assemble(tensors, cfg: ModelConfig, dtype, where: str = "") -> Params:
    """The params tree from (file tensor name, our path "embed" or "layers/q/3", the array
    as the file lays it out, whether to transpose it) -- each checked against the shape the
    config implies, the per-layer ones stacked [L, ...]. `where` prefixes the errors."""
    shapes = param_shapes(cfg)
    params: dict = {"layers": {}}
    # each per-layer weight is copied into its [L, ...] array as it is read, and each array
    # leaves numpy as it goes to JAX: the peak is about one copy of the model, not three
    # (a list of layers, its stack, the device array: 15 GB for Qwen2.5-1.5B, now 8)
    per_layer: dict[str, np.ndarray] = {}
    filled: set[tuple[str, int]] = set()
    for name, ours, x, transpose in tensors:
        x = x.T if transpose else x
        parts = ours.split("/")
        want = shapes[parts[0]] if len(parts) == 1 else shapes["layers"][parts[1]][1:]
        if tuple(x.shape) != tuple(want):
            stored = tuple(x.T.shape) if transpose else tuple(x.shape)
            raise ValueError(f"{where}tensor {name} has shape {stored}, config implies "
                             f"{tuple(want[::-1]) if transpose else tuple(want)}")
        if len(parts) == 1:
            params[ours] = jnp.asarray(x, dtype)
        else:
            if parts[1] not in per_layer:
                per_layer[parts[1]] = np.empty(shapes["layers"][parts[1]], x.dtype)
            per_layer[parts[1]][int(parts[2])] = x
            filled.add((parts[1], int(parts[2])))
    unset = sorted(f"layers/{n}/{i}" for n in per_layer for i in range(cfg.num_layers)
                   if (n, i) not in filled)
    if unset:
        raise ValueError(f"{where}no tensor for {unset[:5]}")
    for n in list(per_layer):
        params["layers"][n] = jnp.asarray(per_layer.pop(n), dtype)
    return params


def generation_eos(path: str | Path) -> tuple[int, ...]:
    """`eos_token_id` of the checkpoint's generation_config.json (an int or a list; () when
    the file or the field is absent): where instruct checkpoints keep their end-of-turn
    token (Llama-3-Instruct's <|eot_id|>), which config.json often lacks."""
    f = Path(path) / "generation_config.json"
    if not f.exists():
        return ()
    try:
        gen = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f}: not JSON ({e})") from None
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in eos):
        raise ValueError(f"{f}: eos_token_id={gen['eos_token_id']!r} must be a token id or a "
                         "list of token ids")
    return tuple(eos)


def _load_sharded(files, expected, shapes, dtype, shardings) -> Params:
    """`load_hf`'s params, each built from its shards: every tensor's shape is checked from
    the headers first (the errors of a whole load), then each device's slice is read from
    the memory-mapped files and converted to `dtype`."""
    views: dict[str, dict] = {}
    for name, (ours, transpose) in expected.items():
        parts = ours.split("/")
        want = shapes[parts[0]] if len(parts) == 1 else shapes["layers"][parts[1]][1:]
        x = _mapped(files[name], name)
        x = x.T if transpose else x
        if tuple(x.shape) != tuple(want):
            stored = tuple(x.T.shape) if transpose else tuple(x.shape)
            raise ValueError(f"tensor {name} has shape {stored}, config implies "
                             f"{tuple(want[::-1]) if transpose else tuple(want)}")
        key = parts[0] if len(parts) == 1 else parts[1]
        views.setdefault(key, {})[int(parts[2]) if len(parts) == 3 else 0] = x
    target = np.dtype(dtype)

    def build(key: str, shape: tuple, sharding, stacked: bool):
        xs = [views[key][i] for i in sorted(views[key])]
        done: dict = {}  # devices holding the same slice (replicas) read it once

        def slice_of(index):
            k = tuple((s.start, s.stop, s.step) for s in index)
            if k not in done:
                if stacked:  # [L, ...]: one tensor per layer
                    rows = range(len(xs))[index[0]]
                    done[k] = np.stack([np.asarray(xs[i][index[1:]]) for i in rows]
                                       ).astype(target)
                else:
                    done[k] = np.asarray(xs[0][index]).astype(target)
            return done[k]

        return jax.make_array_from_callback(tuple(shape), sharding, slice_of, dtype=target)

    params: dict = {k: build(k, v, shardings[k], False)
                    for k, v in shapes.items() if k != "layers"}
    params["layers"] = {k: build(k, v, shardings["layers"][k], True)
                        for k, v in shapes["layers"].items()}
    return params


def save_hf(path: str | Path, cfg: ModelConfig, params: Params, extra_config: dict | None = None) -> None:
    """Write params as an HF checkpoint directory (config.json + model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (ours, transpose) in _hf_names(cfg).items():
        parts = ours.split("/")
        x = params[ours] if len(parts) == 1 else params["layers"][parts[1]][int(parts[2])]
        x = np.asarray(x)
        tensors[name] = np.ascontiguousarray(x.T if transpose else x)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(np.asarray(params["embed"]).dtype)
    hf.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def weights_sha256(model_dir: str | Path) -> str | None:
    """sha256 of the checkpoint's safetensors files (or of a GGUF file): which weights a
    result belongs to."""
    path = Path(model_dir)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        file_sha256(f, h)
    return h.hexdigest()


def file_sha256(path: str | Path, h=None) -> str:
    """sha256 of a file read in chunks (a GGUF file can be GBs); `h`: a running hash to
    update instead of a new one."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as src:
        while chunk := src.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def provenance(model_dir: str | Path | None) -> dict:
    """{"sha256", "trained_steps"} of a checkpoint directory (None where unknown): results
    name the weights they were measured on, so a retrained model cannot pass for the old."""
    if model_dir is None:
        return {"sha256": None, "trained_steps": None}
    import yaml

    cfg = Path(model_dir) / "train_config.yaml"
    steps = (yaml.safe_load(cfg.read_text()) or {}).get("trained_steps") if cfg.is_file() else None
    return {"sha256": weights_sha256(model_dir), "trained_steps": steps}
