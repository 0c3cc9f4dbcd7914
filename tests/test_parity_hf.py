"""Parity with HF transformers (PyTorch, fp32, CPU, eager attention) on tiny random models.

Seen on this machine (2-layer models, logits of magnitude 30-50): prefill logits differ by
at most ~3e-5 and decode-step logits by ~3e-5, i.e. ~1e-6 relative. The tolerance, 2e-4
absolute, is < 10x that; a single wrong RoPE frequency, norm or mask moves logits by >0.1.
"""

from __future__ import annotations

import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")

from kvjax import engine  # noqa: E402
from kvjax.compression.cache import KVCache  # noqa: E402
from kvjax.methods import Method  # noqa: E402
from kvjax.models.checkpoint import load_hf  # noqa: E402

TOL = 2e-4
STEPS = 8


@pytest.fixture(scope="module", params=sorted(hf_models.FAMILIES))
def pair(request):
    model = hf_models.build(request.param)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = load_hf(d)
    return request.param, model, cfg, params


def _hf_greedy(model, ids, steps):
    """Per-step logits of HF greedy decoding through its own KV cache."""
    with torch.no_grad():
        out = model(torch.tensor(ids), use_cache=True)
        logits, past = [out.logits[:, -1].numpy()], out.past_key_values
        for _ in range(steps):
            tok = torch.tensor(logits[-1].argmax(-1))[:, None]
            out = model(tok, past_key_values=past, use_cache=True)
            logits.append(out.logits[:, -1].numpy())
            past = out.past_key_values
    return np.stack(logits, 1)  # [B, steps+1, V]


def test_prefill_logits_all_positions(pair):
    name, model, cfg, params = pair
    ours, ref = hf_models.prefill_logits(model, cfg, params)
    err = np.abs(ours - ref).max()
    assert err < TOL, f"{name}: prefill max abs diff {err:.2e}"


def test_decode_steps_through_cache(pair):
    """Prefill, then 8 greedy steps through kvjax's cache: logits of every step match HF."""
    name, model, cfg, params = pair
    ids = np.random.default_rng(2).integers(3, cfg.vocab_size, size=(1, 29))
    ref = _hf_greedy(model, ids, STEPS)
    method = Method()
    tokens, valid = engine.pad_left([list(ids[0])], 32, cfg.pad_token_id)
    logits, cache, _, _ = engine.prefill(params, tokens, valid, cfg=cfg, method=method,
                                      capacity=32 + STEPS)
    ours = [np.asarray(logits)]
    for _ in range(STEPS):
        tok = jnp.argmax(logits, -1)[:, None].astype(jnp.int32)
        logits, cache, _ = engine.extend(params, cache, tok, jnp.ones((1, 1), bool),
                                         cfg=cfg, method=method)
        ours.append(np.asarray(logits))
    ours = np.stack(ours, 1)
    err = np.abs(ours - ref).max()
    assert err < TOL, f"{name}: decode max abs diff {err:.2e} (per step {np.abs(ours - ref).max(-1)})"
    # the same tokens come out of the jitted while_loop
    gen = engine.run(params, cfg, [list(ids[0])], max_new_tokens=STEPS, stop_ids=())
    assert gen.tokens[0] == list(ref[0, :STEPS].argmax(-1))
    assert isinstance(cache, KVCache)


def test_hf_generate_matches(pair):
    """End to end: kvjax greedy tokens equal `transformers` `generate` greedy tokens."""
    name, model, cfg, params = pair
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, size=(1, 21))
    with torch.no_grad():
        ref = model.generate(torch.tensor(ids), max_new_tokens=STEPS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, 21:].tolist()
    gen = engine.run(params, cfg, [list(ids[0])], max_new_tokens=STEPS, stop_ids=())
    assert gen.tokens[0] == ref
