"""HF checkpoint I/O: bit-exact round trips and errors that name the bad tensor."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvjax.config import ModelConfig
from kvjax.models.checkpoint import load_hf, save_hf

hf_models = pytest.importorskip("hf_models")


@pytest.fixture(scope="module", params=["llama_llama3rope_gqa4", "qwen2_bias_gqa2", "qwen3_qknorm_gqa2"])
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf_models.build(request.param).save_pretrained(d)
    return d


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_round_trip_bit_exact(saved, tmp_path):
    cfg, params = load_hf(saved)
    save_hf(tmp_path, cfg, params)
    cfg2, params2 = load_hf(tmp_path)
    assert cfg2 == cfg
    assert _equal(params, params2)
    # the tensors themselves are the original HF tensors, bit for bit
    orig, ours = load_file(str(saved / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    if cfg.tie_word_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(orig) == sorted(ours)
    assert all(np.array_equal(orig[k], ours[k]) for k in orig)


def test_export_loads_in_transformers(saved, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    cfg, params = load_hf(saved)
    save_hf(tmp_path, cfg, params)
    ref = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2, 8]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, back(ids).logits)


def test_sharded_checkpoint(saved, tmp_path):
    tensors = load_file(str(saved / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    assert _equal(load_hf(saved)[1], load_hf(tmp_path)[1])


def _rewrite(saved, tmp_path, edit):
    tensors = load_file(str(saved / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    return tmp_path


def test_missing_tensor_is_named(saved, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    d = _rewrite(saved, tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf(d)


def test_reshaped_tensor_is_named(saved, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    d = _rewrite(saved, tmp_path, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        load_hf(d)


def test_unexpected_tensor_is_named(saved, tmp_path):
    d = _rewrite(saved, tmp_path, lambda t: t.__setitem__("model.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match=r"model\.extra\.weight"):
        load_hf(d)


def test_unsupported_architecture_and_rope():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig.from_hf({**base, "num_key_value_heads": 3})


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_models.build("llama_mha_tied").config.to_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(tmp_path)


# ---- a damaged checkpoint names the file and the tensor (docs/reliability.md) ----------------


def _copy(saved, tmp_path):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((saved / f).read_bytes())
    return tmp_path


def _last_tensor(f):
    """(name, end offset in the file) of the tensor stored last in a safetensors file."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = {k: v for k, v in json.loads(raw[8: 8 + n]).items() if k != "__metadata__"}
    name = max(meta, key=lambda k: meta[k]["data_offsets"][1])
    return name, 8 + n + meta[name]["data_offsets"][1]


def test_truncated_file_names_file_and_tensor(saved, tmp_path):
    d = _copy(saved, tmp_path)
    f = d / "model.safetensors"
    name, end = _last_tensor(f)
    f.write_bytes(f.read_bytes()[: end - 8])  # the last tensor loses its last 8 bytes
    with pytest.raises(ValueError, match=rf"model\.safetensors is truncated: tensor "
                                         rf"{name.replace('.', '[.]')}"):
        load_hf(d)
    f.write_bytes(f.read_bytes()[:20])  # not even the header
    with pytest.raises(ValueError, match=r"model\.safetensors is not a complete safetensors"):
        load_hf(d)


def test_truncated_shard_through_the_index(saved, tmp_path):
    """Read through model.safetensors.index.json (no header pass first): it was `cannot
    reshape array of size 0`."""
    tensors = load_file(str(saved / "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    b = tmp_path / "b.safetensors"
    name, end = _last_tensor(b)
    b.write_bytes(b.read_bytes()[: end - 4])
    with pytest.raises(ValueError, match=rf"b\.safetensors is truncated: tensor "
                                         rf"{name.replace('.', '[.]')}"):
        load_hf(tmp_path)
    b.unlink()
    with pytest.raises(FileNotFoundError, match=r"shard b\.safetensors listed in .*index"):
        load_hf(tmp_path)


def test_config_errors_name_the_file_and_field(saved, tmp_path):
    d = _copy(saved, tmp_path)
    hf = json.loads((saved / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in hf.items()
                                               if k != "hidden_size"}))
    with pytest.raises(ValueError, match=r"config\.json: config field 'hidden_size' is missing"):
        load_hf(d)
    (d / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": "2"}))
    with pytest.raises(ValueError, match=r"num_hidden_layers='2' must be a positive integer"):
        load_hf(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: Expecting"):
        load_hf(d)
