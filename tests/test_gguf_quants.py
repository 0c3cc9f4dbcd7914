"""llama.cpp's weight types (`kvjax.models.quants`) and the GGUF container reader
(`kvjax.models.gguf_reader`) against the `gguf` package, llama.cpp's own Python port.

Dequantization is held equal bit for bit (float32 bit patterns; NaN where the reference has
NaN): the same integer codes, scales and float operations in the same order give the same
bits, so any difference is a wrong layout, order or rounding. Blocks are random bytes, which
reach every code, every packed-scale bit and (in a fifth of the blocks) every float16 scale,
infinities and NaNs included."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import gguf_files
import hf_models
from kvjax.models import gguf as kg
from kvjax.models import gguf_reader, quants

BLOCK_TYPES = [k for k in quants.BLOCKS if k != "Q8_K"]  # gguf dequantizes these


def _assert_same_bits(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == ref.dtype == np.float32 and ours.shape == ref.shape
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def _random(kind: str, blocks: int, seed: int) -> np.ndarray:
    """Random blocks; four in five with finite scales of a weight's size."""
    size = quants.BLOCKS[kind][0]
    raw = np.random.default_rng(seed).integers(0, 256, (blocks, quants.BLOCKS[kind][1]),
                                               dtype=np.uint8)
    if kind == "Q8_K":  # a float32 scale
        raw[:, :4] = np.float32(np.random.default_rng(seed).uniform(-1, 1, blocks) / 127) \
            .view(np.uint8).reshape(-1, 4)
        return raw
    finite = gguf_files.random_blocks(blocks, size, kind, 0.1, seed)
    keep = np.random.default_rng(seed + 1).random(blocks) < 0.8
    raw[keep] = finite[keep]
    return raw


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_blocks_equal_gguf_bit_for_bit(kind):
    raw = _random(kind, 3000, seed=len(kind) + quants.BLOCKS[kind][1])
    with np.errstate(all="ignore"):  # NaN and infinite scales
        ours = quants.dequantize(raw, kind, raw.shape[0] * quants.BLOCKS[kind][0])
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1)
    _assert_same_bits(ours, ref)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_floats_equal_gguf_bit_for_bit(kind):
    raw = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    t = gguf.GGMLQuantizationType[kind]
    ref = gguf.quants.dequantize(raw.view({"F32": np.float32, "F16": np.float16,
                                           "BF16": np.uint8}[kind]), t)
    count = raw.size // (4 if kind == "F32" else 2)
    with np.errstate(all="ignore"):
        ours = quants.dequantize(raw, kind, count)
    _assert_same_bits(ours, np.asarray(ref, np.float32).ravel())


def test_q8_k_is_its_c_loop():
    """`gguf` has no Q8_K: the reference is ggml-quants.c's loop, `y[j] = x.d * x.qs[j]`
    (a float32 scale, 256 int8 codes, then 16 int16 sums the dequantization ignores)."""
    raw = np.random.default_rng(4).integers(0, 256, (5, 292), dtype=np.uint8)
    raw[:, :4] = np.float32([0.5, -2.0, 1e-3, 3.0, 0.0]).view(np.uint8).reshape(5, 4)
    want = np.empty((5, 256), np.float32)
    for i in range(5):
        d = np.frombuffer(raw[i, :4].tobytes(), np.float32)[0]
        for j in range(256):
            want[i, j] = np.float32(d) * np.float32(np.int8(raw[i, 4 + j].view(np.int8)))
    _assert_same_bits(quants.dequantize(raw, "Q8_K", 5 * 256), want.ravel())


def test_a_wrong_byte_count_is_named():
    with pytest.raises(ValueError, match=r"512 weights of type Q4_K take 288 bytes, not 287"):
        quants.dequantize(np.zeros(287, np.uint8), "Q4_K", 512)


def _every_type_file(path):
    """One 2-D tensor of every type, 3 rows of 512 (the writer's shape: rows, bytes a row)."""
    w = gguf.GGUFWriter(str(path), "llama")
    want = {}
    for kind in quants.TYPES:
        t = gguf.GGMLQuantizationType[kind]
        if kind in quants.FLOATS:
            x = np.random.default_rng(7).standard_normal((3, 512)).astype(np.float32)
            raw = {"F32": x, "F16": x.astype(np.float16)}.get(kind)
            if raw is None:  # BF16: the writer takes the bytes
                raw = gguf.quants.quantize(x, t)
                w.add_tensor(f"t.{kind}", raw, raw_dtype=t)
            else:
                w.add_tensor(f"t.{kind}", raw)
        else:
            raw = _random(kind, 3 * 512 // quants.BLOCKS[kind][0], seed=9).reshape(3, -1)
            w.add_tensor(f"t.{kind}", raw, raw_dtype=t)
        want[kind] = raw
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    return want


def test_tensors_written_to_a_file_equal_gguf(tmp_path):
    """Every type through the file: our reader's bytes, shape and type, dequantized, equal
    `gguf`'s reader and dequantization of the same tensor (Q8_K: its C loop)."""
    f = tmp_path / "types.gguf"
    _every_type_file(f)
    theirs = {t.name: t for t in gguf.GGUFReader(str(f)).tensors}
    for t in kg.reader(f).tensors:
        ref = theirs[t.name]
        assert (t.kind, t.shape) == (ref.tensor_type.name, tuple(ref.shape.tolist()))
        with np.errstate(all="ignore"):
            ours = kg.dequantize(t, f)
        assert ours.shape == (3, 512)
        if t.kind == "Q8_K":
            raw = np.asarray(ref.data).reshape(-1, 292)
            want = (raw[:, :4].copy().view(np.float32) * raw[:, 4:260].view(np.int8)).ravel()
        else:
            with np.errstate(all="ignore"):
                want = np.asarray(gguf.quants.dequantize(np.asarray(ref.data), ref.tensor_type),
                                  np.float32).ravel()
        _assert_same_bits(ours.ravel(), want)


def test_reader_equals_gguf_reader_on_a_model_file(tmp_path):
    """Metadata (numbers, strings, arrays of both) and every tensor's bytes."""
    import hf_tokenizers

    d = hf_tokenizers.qwen2(tmp_path / "tok")
    f = gguf_files.write(tmp_path / "m.gguf", hf_models.build("qwen2_bias_gqa2"), "Q4_1",
                         tok_dir=d, pre="qwen2")
    ours, ref = kg.reader(f), gguf.GGUFReader(str(f))
    assert ours.fields == {k: v.contents() for k, v in ref.fields.items()
                           if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.shape, a.kind, a.n_elements) == (tuple(b.shape.tolist()),
                                                   b.tensor_type.name, b.n_elements)
        np.testing.assert_array_equal(a.data, np.asarray(b.data).reshape(-1).view(np.uint8))


def test_truncated_and_foreign_files_are_named(tmp_path):
    f = gguf_files.write(tmp_path / "m.gguf", hf_models.build("llama_mha_tied"), "Q8_0")
    data = f.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    with pytest.raises(ValueError, match=rf"truncated: {len(data) - 1000} of (\d+) bytes") as e:
        kg.load(cut)
    need = int(e.value.args[0].split(" of ")[1].split()[0])
    assert len(data) - 32 < need <= len(data)  # the last tensor's end, before its padding
    cut.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"truncated: its metadata runs past its 200 bytes"):
        kg.load(cut)
    (tmp_path / "x.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match=r"is not a GGUF file"):
        kg.load(tmp_path / "x.gguf")


# a Q4_K_M-like mix, as llama.cpp writes Qwen2.5's: Q4_K, Q6_K for ffn_down, Q5_0 / Q8_0
Q4_K_M = {"": "Q4_K", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q5_0",
          "output.weight": "Q8_0", "attn_v.weight": "Q6_K"}


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1",
                                   "Q4_K_M"])
@pytest.mark.parametrize("arch", ["llama_mha_tied", "qwen2_bias_gqa2"])
def test_k_quant_models_equal_transformers(arch, qtype, tmp_path):
    """A whole model in each new type (and the Q4_K_M mix) loads as transformers loads it:
    the weights exactly, and logits within 1e-5 of the largest logit: float32
    reassociation noise, which grows with the logits (here 30-1100: width 256 and the
    random blocks' scales; measured 3e-7 to 2.1e-6 of the largest), where a wrong layout
    would be off by O(1) of it. Widths are multiples of 256, a K-quant super-block;
    llama's q/k rows are un-permuted."""
    from test_gguf import _transformers_gguf

    model = hf_models.build(arch, hidden_size=256, intermediate_size=512,
                            tie_word_embeddings=False)
    f = gguf_files.write(tmp_path / "m.gguf", model, Q4_K_M if qtype == "Q4_K_M" else qtype)
    cfg, params = kg.load(f)
    ref = _transformers_gguf(f)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    for ours, hf in (("q", "self_attn.q_proj.weight"), ("down", "mlp.down_proj.weight"),
                     ("v", "self_attn.v_proj.weight")):
        np.testing.assert_array_equal(np.asarray(params["layers"][ours][1]),
                                      sd[f"model.layers.1.{hf}"].T)
    np.testing.assert_array_equal(np.asarray(params["embed"]), sd["model.embed_tokens.weight"])
    ours, theirs = hf_models.prefill_logits(ref, cfg, params)
    assert np.abs(ours - theirs).max() < 1e-5 * np.abs(theirs).max()


def test_other_types_are_refused_by_name(tmp_path):
    """IQ* and TQ* (lattice and ternary codes) are not dequantized: one error naming the
    tensor, its type and the supported list."""
    f = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    t = gguf.GGMLQuantizationType.IQ4_NL
    w.add_tensor("token_embd.weight", np.zeros((4, 18), np.uint8), raw_dtype=t)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    r = kg.reader(f)
    with pytest.raises(ValueError, match=r"tensor token_embd.weight has type IQ4_NL; supported: "
                                         r"F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, "
                                         r"Q3_K, Q4_K, Q5_K, Q6_K, Q8_K"):
        kg.dequantize(r.tensors[0], f)
