"""The shipped model: loads in PyTorch `transformers` and gives kvjax's logits.

fp32 on CPU; seen: max abs diff ~1e-5 on logits of magnitude ~10-20 over a 512-token task
prompt. Tolerance 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax import engine
from kvjax.api import BUNDLED_DIR
from kvjax.engine import layers
from kvjax.models import transformer

PATH = BUNDLED_DIR / "tiny-retrieval"
pytestmark = pytest.mark.skipif(not (PATH / "config.json").exists(),
                                reason=f"bundled model not built yet ({PATH}); run python -m kvjax.train")


def test_shipped_weights_match_transformers():
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    import transformers

    model = kvjax.load("tiny-retrieval")
    s = kvjax.tasks.generate("niah_multikey", context_length=512, n=1, seed=0)[0]
    ids = model.encode(s.prompt)
    assert len(ids) == 512
    hf = transformers.AutoModelForCausalLM.from_pretrained(PATH, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.float().numpy()[0]
    valid = jnp.ones((1, len(ids)), bool)
    pos = engine.positions(valid, jnp.zeros(1, jnp.int32))
    x, _, _ = layers.prefill_layers(model.params, model.cfg, jnp.asarray([ids]), valid, pos,
                                  lambda io, st: (None, st))
    ours = np.asarray(transformer.unembed(model.params, model.cfg, x))[0]
    assert np.abs(ours - ref).max() < 1e-4


def test_shipped_tokenizer_loads_in_transformers():
    pytest.importorskip("torch")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(PATH)
    model = kvjax.load("tiny-retrieval")
    text = "the special magic number for hedgehog is 9764969."
    assert tok(text, add_special_tokens=False)["input_ids"] == model.encode(text, bos=False)
