"""An HF checkpoint reads, tokenizes and runs in kvjax as in transformers (everything built
offline: tokenizer files by `hf_tokenizers`, tiny random models by `hf_models`).

- Tokenization: `Model.encode` equals `AutoTokenizer(...)["input_ids"]` exactly (ids are
  integers: no tolerance) on Llama-3-style files (bos from the post-processor),
  Qwen2-style files (no bos), a post-processor that appends an eos, and files whose
  tokenizer_config.json sets add_bos_token / add_eos_token (transformers 5 ignores them
  when tokenizer.json exists; so does kvjax).
- Chat template: the rendering and its ids equal `apply_chat_template(...,
  add_generation_prompt=True)`; the context-only cut joins back to them.
- eos: the union of config.json's and generation_config.json's ids stops generation where
  HF `generate` stops.
- YaRN: inv_freq and the attention factor equal `ROPE_INIT_FUNCTIONS["yarn"]` to 1e-6
  relative (numpy's and torch's float32 `pow` differ by an ulp); a tiny Qwen2 with yarn
  gives HF's logits.
- Qwen2/Qwen3 sliding window (`use_sliding_window`, `sliding_window`, `max_window_layers`,
  `layer_types`): HF's logits at prefill and through the cache.

Logit tolerance: 2e-4 absolute on logits of magnitude 30-50, as tests/test_parity_hf.py
(seen: ~2.5e-5); dropping YaRN's attention factor or a layer's window moves them by > 9.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_models = pytest.importorskip("hf_models")
import hf_tokenizers  # noqa: E402

import kvjax  # noqa: E402
from kvjax import engine  # noqa: E402
from kvjax.config import ModelConfig  # noqa: E402
from kvjax.methods import Method  # noqa: E402
from kvjax.models import rope, transformer  # noqa: E402
from kvjax.models.checkpoint import load_hf  # noqa: E402

from test_cli_api import model_dir  # noqa: E402, F401 -- the tiny checkpoint fixture

TOL = 2e-4
TEXTS = ["The river Elm flows past Norby.", "Which town?  Answer 1234567 <|eot_id|> x",
         "  leading spaces\n\nand newlines\n", "café résumé 12", ""]
CONTEXT = "Read the following text.\n\nThe river Elm flows past the town of Norby."
QUESTION = "Question: Which town does the river Elm flow past? Answer:"


def _checkpoint(d, style: str, vocab: int = 448, eos_processor: bool = False, **tok_config):
    """A tiny Qwen2 checkpoint (vocabulary >= the tokenizer's) with `style`'s tokenizer;
    `eos_processor`: tokenizer.json's post-processor appends <|endoftext|>."""
    hf_models.build("qwen2_bias_gqa2", vocab_size=vocab).save_pretrained(d)
    if style == "llama3":
        hf_tokenizers.llama3(d)
    else:
        hf_tokenizers.qwen2(d)
    if eos_processor:
        from tokenizers import Tokenizer, processors

        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        eos = "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B:1 {eos}:1",
            special_tokens=[(eos, tok.token_to_id(eos))])
        tok.save(str(d / "tokenizer.json"))
    if tok_config:
        f = d / "tokenizer_config.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), **tok_config}))
    return d


STYLES = {  # name: (files, _checkpoint's options)
    "llama3": ("llama3", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_eos_processor": ("qwen2", {"eos_processor": True}),
    "llama3_add_bos_false": ("llama3", {"add_bos_token": False}),
    "qwen2_add_bos_eos": ("qwen2", {"add_bos_token": True, "add_eos_token": True,
                                    "bos_token": "<|endoftext|>"}),
}


@pytest.fixture(scope="module", params=sorted(STYLES))
def pair(request, tmp_path_factory):
    style, extra = STYLES[request.param]
    d = _checkpoint(tmp_path_factory.mktemp(request.param), style, **extra)
    return request.param, kvjax.load(d), transformers.AutoTokenizer.from_pretrained(d)


def _ids(x):
    return x["input_ids"] if hasattr(x, "keys") else x


def test_encode_equals_transformers(pair):
    name, model, hf = pair
    for text in TEXTS:
        assert model.encode(text) == hf(text)["input_ids"], (name, text)
        assert model.encode(text, bos=False) == hf(text, add_special_tokens=False)["input_ids"]
    first = model.encode("Which town?")[0]
    if name == "qwen2":  # the issue: no <|endoftext|> in front of every prompt
        assert first != hf.convert_tokens_to_ids("<|endoftext|>")
    if name == "llama3":
        assert first == hf.convert_tokens_to_ids("<|begin_of_text|>")
    if name == "qwen2_eos_processor":  # the issue's [258, 259, 6]: eos behind, no bos
        assert model.encode("Which town?")[-1] == hf.convert_tokens_to_ids("<|endoftext|>")
    assert model.decode(model.encode(TEXTS[0])) == hf.decode(hf(TEXTS[0])["input_ids"],
                                                             skip_special_tokens=True)


def test_chat_template_equals_transformers(pair):
    name, model, hf = pair
    if hf.chat_template is None:
        pytest.skip("no template")
    text = CONTEXT + " " + QUESTION
    msgs = [{"role": "user", "content": text}]
    assert model.render_chat(text) == hf.apply_chat_template(msgs, add_generation_prompt=True,
                                                             tokenize=False)
    want = _ids(hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    ctx, rest = model.prompt_ids(CONTEXT, QUESTION, chat=True)
    assert ctx + rest == want
    # the cut is where the context ends: the compressed part is the rendering up to the
    # context's end, the prefilled part the question, the turn's end, the generation prompt
    rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert hf.decode(ctx) == rendered[: rendered.index(CONTEXT) + len(CONTEXT)]
    assert hf.decode(rest) == rendered[rendered.index(CONTEXT) + len(CONTEXT):]
    assert hf.decode(rest).startswith(" " + QUESTION)


def test_context_only_cut_is_the_whole_prompts_ids(pair):
    """Both scenarios see the same ids: the cut of the tokenized prompt is, here, also what
    the two parts tokenize to alone (byte-level BPE keeps the space with the next word)."""
    name, model, hf = pair
    ctx, rest = model.prompt_ids(CONTEXT, QUESTION)
    full = hf(CONTEXT + " " + QUESTION)["input_ids"]
    assert ctx + rest == full
    plain = hf(CONTEXT, add_special_tokens=False)["input_ids"]
    q = hf(" " + QUESTION, add_special_tokens=False)["input_ids"]
    assert ctx[len(ctx) - len(plain):] == plain and rest[: len(q)] == q
    # the special tokens stay at their ends: in front of the context, behind the question
    assert ctx[: len(ctx) - len(plain)] == full[: len(ctx) - len(plain)]
    assert rest[len(q):] == full[len(ctx) + len(q):]


def test_chat_template_file_wins(tmp_path):
    """transformers 5 saves templates as chat_template.jinja, read before the config's."""
    d = _checkpoint(tmp_path, "qwen2")
    (d / "chat_template.jinja").write_text("{{ bos_token or '' }}[{{ messages[0]['content'] }}]"
                                           "{% if add_generation_prompt %}>{% endif %}")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    model = kvjax.load(d)
    msgs = [{"role": "user", "content": "hi there"}]
    assert model.render_chat("hi there") == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False) == "[hi there]>"


def test_chat_template_that_rewrites_the_message_is_refused(tmp_path):
    d = _checkpoint(tmp_path, "qwen2")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    model = kvjax.load(d)
    assert model.render_chat("ab") == "AB"
    with pytest.raises(ValueError, match="rewrites the message text"):
        model.prompt_ids("ab", "cd", chat=True)


def test_task_tokenizer_is_unchanged():
    """The bundled model's word-level tokenizer keeps its own <bos> and no template."""
    from kvjax.api import Model
    from kvjax.tasks import tokenizer as task_tok

    cfg = ModelConfig(family="llama", vocab_size=1408, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=64, bos_token_id=1)
    model = Model(cfg, {}, "t", None, task_tok.build_tokenizer())
    assert model.encode("the sky is blue .") == [1, *task_tok.encode("the sky is blue .")]
    assert model.prompt_ids("the sky", "is blue") == (model.encode("the sky"),
                                                      model.encode("is blue", bos=False))
    with pytest.raises(ValueError, match="no chat template"):
        model.prompt_ids("the sky", "is blue", chat=True)


# ---- eos from generation_config.json ---------------------------------------------------------


def test_generation_config_eos_stops_where_hf_generate_stops(tmp_path):
    """generation_config.json's eos ids replace config.json's, as in transformers'
    generate: config.json names a token generated before the instruct end-of-turn, and
    neither HF nor kvjax stops there."""
    model = hf_models.build("llama_mha_tied")
    model.save_pretrained(tmp_path)
    for seed in range(3, 40):  # prompts whose free run has two distinct tokens, then a third
        ids = np.random.default_rng(seed).integers(3, 97, size=(1, 21))
        with torch.no_grad():
            free = model.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, 21:].tolist()
        firsts = list(dict.fromkeys(t for t in free if t != 2))
        if len(firsts) >= 2 and free.index(firsts[1]) < 7:
            break
    early, stop = firsts[0], firsts[1]  # stop: an end-of-turn only generation_config has
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": early}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, stop], "do_sample": False}))
    ours = kvjax.load(tmp_path)
    assert ours.cfg.eos_token_ids == (2, stop)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0)[0, 21:].tolist()
    assert ref[-1] == stop and early in ref[:-1], (ref, early, stop)
    got = kvjax.generate(ours, ids[0], max_new_tokens=8).tokens
    assert got == ref[:-1]  # kvjax returns the tokens before the stop token


def test_bad_generation_config_is_named(tmp_path):
    hf_models.build("llama_mha_tied").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id='x'"):
        kvjax.load(tmp_path)


# ---- YaRN ----------------------------------------------------------------------------------

YARN = [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128,
     1e6, 131072),  # Qwen2.5's long-context setting
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 16, 1e6, 512),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
      "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0,
      "truncate": False}, 64, 1e4, 32768),
    ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3}, 32, 5e5, 1024),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256}, 32, 1e4,
     1024),  # the factor is the ratio of the lengths
]


@pytest.mark.parametrize("rs,head_dim,theta,max_pos", YARN)
def test_yarn_frequencies_equal_transformers(rs, head_dim, theta, max_pos):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.Qwen2Config(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=max_pos,
                                  rope_theta=theta, rope_scaling=dict(rs))
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.rope_scaling.rope_type == "yarn"
    np.testing.assert_allclose(rope.inv_freq(cfg), want.numpy(), rtol=1e-6, atol=0)
    assert rope.attention_scaling(cfg) == pytest.approx(scale, rel=1e-12)
    back = ModelConfig.from_hf(cfg.to_hf())  # the written config reads back the same
    assert back.rope_scaling == cfg.rope_scaling



def test_yarn_length_and_rope_theta_precedence():
    """Qwen2.5's long-context yarn leaves max_position_embeddings at the original 32768:
    the model takes factor x original tokens (vLLM's limit; transformers sets none). And
    transformers 5 takes `rope_parameters["rope_theta"]` over the top-level field."""
    from kvjax import engine

    hf = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=32768,
                                  rope_theta=1e6, rope_scaling={
                                      "rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768}).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.max_position_embeddings == 32768 and cfg.max_positions == 131072
    assert engine.check_tokens(cfg, [[5] * 40000], None, 32) == 40000
    with pytest.raises(ValueError, match="yarn length .*=131072"):
        engine.check_tokens(cfg, [[5] * 131072], None, 1)
    plain = ModelConfig.from_hf({**hf, "rope_scaling": None, "rope_parameters": None})
    assert plain.max_positions == 32768
    both = {k: v for k, v in hf.items() if k != "rope_scaling"}
    both.update(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ModelConfig.from_hf(both).rope_theta == 5e5
    assert ModelConfig.from_hf({**both, "rope_parameters": {"rope_type": "default"}}
                               ).rope_theta == 1e4

def _decode_logits(model, cfg, params, steps=8, n=29):
    """Prefill, then greedy steps through kvjax's cache and HF's: logits of every step."""
    ids = np.random.default_rng(2).integers(3, cfg.vocab_size, size=(1, n))
    with torch.no_grad():
        out = model(torch.tensor(ids), use_cache=True)
        ref, past = [out.logits[:, -1].numpy()], out.past_key_values
        for _ in range(steps):
            out = model(torch.tensor(ref[-1].argmax(-1))[:, None], past_key_values=past,
                        use_cache=True)
            ref.append(out.logits[:, -1].numpy())
            past = out.past_key_values
    tokens, valid = engine.pad_left([list(ids[0])], 32, cfg.pad_token_id)
    logits, cache, _, _ = engine.prefill(params, tokens, valid, cfg=cfg, method=Method(),
                                         capacity=32 + steps)
    ours = [np.asarray(logits)]
    for _ in range(steps):
        tok = jnp.argmax(logits, -1)[:, None].astype(jnp.int32)
        logits, cache, _ = engine.extend(params, cache, tok, jnp.ones((1, 1), bool), cfg=cfg,
                                         method=Method())
        ours.append(np.asarray(logits))
    return np.stack(ours, 1), np.stack(ref, 1)


def test_yarn_qwen2_logits_equal_transformers(monkeypatch):
    """Positions 0..36 with original_max_position_embeddings=16: the interpolated pairs and
    the attention factor both matter."""
    model, cfg, params = hf_models.build_pair("qwen2_bias_gqa2", rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    assert cfg.rope_scaling.attention_factor > 1.1
    ours, ref = hf_models.prefill_logits(model, cfg, params)
    assert np.abs(ours - ref).max() < TOL
    ours, ref = _decode_logits(model, cfg, params)
    assert np.abs(ours - ref).max() < TOL
    monkeypatch.setattr(transformer, "attention_scaling", lambda c: 1.0)
    ours, ref = hf_models.prefill_logits(model, cfg, params)
    assert np.abs(ours - ref).max() > 1.0  # the test sees a missing attention factor


# ---- Qwen2 / Qwen3 sliding window ----------------------------------------------------------

WINDOWS = {  # name: (family, config, kvjax's (sliding_window, sliding_layers))
    "qwen2_top_layer": ("qwen2_bias_gqa2", dict(use_sliding_window=True, sliding_window=8,
                                                max_window_layers=1), (8, (1,))),
    "qwen2_every_layer": ("qwen2_bias_gqa2", dict(use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=0), (8, None)),
    "qwen2_layer_types": ("qwen2_bias_gqa2", dict(
        use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"]), (6, (0,))),
    "qwen3_top_layer": ("qwen3_qknorm_gqa2", dict(use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=1), (8, (1,))),
    "qwen2_off": ("qwen2_bias_gqa2", dict(use_sliding_window=False, sliding_window=8,
                                          max_window_layers=0), (None, None)),
}


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_sliding_window_logits_equal_transformers(name):
    family, extra, want = WINDOWS[name]
    model, cfg, params = hf_models.build_pair(family, **extra)
    assert (cfg.sliding_window, cfg.sliding_layers) == want
    ours, ref = hf_models.prefill_logits(model, cfg, params)
    assert np.abs(ours - ref).max() < TOL, name
    ours, ref = _decode_logits(model, cfg, params)
    assert np.abs(ours - ref).max() < TOL, name
    if cfg.sliding_layers is not None:  # the window on the other layer is seen as wrong
        other = tuple(sorted(set(range(cfg.num_layers)) - set(cfg.sliding_layers)))
        ours, ref = hf_models.prefill_logits(model, dataclasses.replace(cfg, sliding_layers=other),
                                    params)
        assert np.abs(ours - ref).max() > 1.0


@pytest.mark.slow  # ~45 s on CI (every prefill kind compiled); CI time, not a weaker check
def test_per_layer_window_runs_every_prefill_kind():
    """Inside the window a window masks nothing: every prefill kind (scan, token
    selection, block pruning) gives the same tokens with a per-layer window as without."""
    _, cfg, params = hf_models.build_pair("qwen2_bias_gqa2", layers=4, use_sliding_window=True,
                                          sliding_window=120, max_window_layers=2)
    assert cfg.sliding_layers == (2, 3)
    plain = dataclasses.replace(cfg, sliding_window=None, sliding_layers=None)
    prompt = list(np.random.default_rng(4).integers(3, 97, 96))
    for name in ("full", "snapkv", "gemfilter", "lazyllm"):
        m = kvjax.methods.create(name)
        m = m.with_budget(48) if m.takes_budget() else m
        a = engine.run(params, cfg, [prompt], m, max_new_tokens=4, stop_ids=()).tokens
        b = engine.run(params, plain, [prompt], m, max_new_tokens=4, stop_ids=()).tokens
        assert a == b, name


def test_sliding_window_fields_are_read_as_hf_reads_them():
    base = dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=4, num_attention_heads=2)
    read = lambda **kw: (lambda c: (c.sliding_window, c.sliding_layers))(  # noqa: E731
        ModelConfig.from_hf({**base, **kw}))
    assert read(sliding_window=16) == (None, None)  # use_sliding_window defaults to false
    assert read(use_sliding_window=True) == (None, None)  # max_window_layers 28 >= 4 layers
    assert read(use_sliding_window=True, max_window_layers=2) == (4096, (2, 3))
    assert read(use_sliding_window=True, sliding_window=None, max_window_layers=0) == \
        (None, None)
    with pytest.raises(ValueError, match="layer_types"):
        read(use_sliding_window=True, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="sliding_window=0"):
        read(use_sliding_window=True, sliding_window=0)
    with pytest.raises(ValueError, match="max_window_layers"):
        read(use_sliding_window=True, max_window_layers="2")
    cfg = ModelConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 3})
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


# ---- dtype -----------------------------------------------------------------------------------


def test_bfloat16_load_and_logits(tmp_path):
    """`dtype="bfloat16"` (the CLI's default on GPU/TPU) loads bf16 weights and keeps HF's
    fp32 logits to bf16 precision: 8 mantissa bits over two layers, ~1% of the logit
    range; a wrong weight layout or RoPE would be off by the range itself."""
    model = hf_models.build("qwen2_bias_gqa2")
    model.save_pretrained(tmp_path)
    ours = kvjax.load(tmp_path, dtype="bfloat16")
    assert all(p.dtype == jnp.bfloat16 for p in ours.params["layers"].values())
    auto = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert kvjax.load(tmp_path, dtype="auto").params["embed"].dtype == auto
    got, ref = hf_models.prefill_logits(model, ours.cfg, ours.params)
    assert np.abs(got - ref).max() < 0.03 * np.abs(ref).max()
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        kvjax.load(tmp_path, dtype="fp8")


def test_round_trip_of_the_new_fields(tmp_path):
    """yarn and a per-layer window survive save_hf -> load_hf and load in transformers."""
    from kvjax.models.checkpoint import save_hf

    model, cfg, params = hf_models.build_pair("qwen2_bias_gqa2", use_sliding_window=True,
                                              sliding_window=8, max_window_layers=1,
                                              rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings":
                                                                16})
    save_hf(tmp_path, cfg, params)
    cfg2, _ = load_hf(tmp_path)
    assert cfg2 == cfg
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():  # float noise only (seen 1.6e-5): the same weights and rope
        assert (back(ids).logits - model(ids).logits).abs().max() < TOL


def test_cli_dtype_is_recorded(model_dir, tmp_path, capsys):  # noqa: F811
    """--dtype reaches the weights and the record; float32 (auto on CPU) keeps the job keys
    of records written before --dtype, so --resume still matches them."""
    from kvjax import report
    from kvjax.cli import main as cli

    if jax.default_backend() != "cpu":
        pytest.skip("auto is float32 on CPU only (bfloat16 on a GPU or TPU)")
    outs = {d: tmp_path / f"{d}.jsonl" for d in ("bfloat16", "auto")}
    argv = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1", "--max-new-tokens", "2", "--no-progress"]
    for dtype, out in outs.items():
        rc = cli.main([*argv, "--dtype", dtype, "--output", str(out)])
        assert rc == 0, capsys.readouterr().err
    # another dtype is another sweep: --resume refuses to mix them, naming the field
    assert cli.main([*argv, "--output", str(outs["bfloat16"]), "--resume"]) == 2
    assert "was measured with dtype='bfloat16', this command has dtype=None" in \
        capsys.readouterr().err
    bf16, auto = report.load_records(*outs.values())
    assert (bf16["dtype"], bf16["job"]["dtype"]) == ("bfloat16", "bfloat16")
    assert auto["dtype"] == "float32" and "dtype" not in auto["job"]
