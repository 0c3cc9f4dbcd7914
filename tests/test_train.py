"""The trainer: loss goes down, and a resumed run reaches the identical state."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest
import yaml

from kvjax import train
from kvjax.config import ModelConfig

CONFIG = {
    "model": dict(family="llama", vocab_size=1408, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=512, bos_token_id=1, eos_token_ids=[2],
                  tie_word_embeddings=True),
    "train": dict(seed=0, steps=8, lr=1e-2, warmup=2, checkpoint_every=4, lm_weight=0.1,
                  curriculum=[[0, 128, 4]], tasks={"niah_single": 1, "passkey": 1}),
}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    p.write_text(yaml.safe_dump(CONFIG))
    return p


def _leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _staged(tmp_path, *curriculum):
    """The TrainConfig of CONFIG with this curriculum."""
    p = tmp_path / "staged.yaml"
    p.write_text(yaml.safe_dump(
        {**CONFIG, "train": {**CONFIG["train"], "curriculum": list(curriculum)}}))
    return train.load_configs(p)[1]


@pytest.mark.slow  # ~35 s on CI: training rarely changes; run with -m slow when it does
def test_loss_decreases_and_resume_is_identical(config_path, tmp_path):
    full = train.train(config_path, tmp_path / "a", log_every=1)
    losses = [r["loss"] for r in full["log"]]
    assert len(losses) == 8 and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.5, losses

    part = train.train(config_path, tmp_path / "b", steps=4, log_every=1)
    assert part["step"] == 4
    resumed = train.train(config_path, tmp_path / "b", log_every=1)  # resumes at 4
    assert [r["step"] for r in resumed["log"]] == [5, 6, 7, 8]
    assert _leaves_equal(resumed["params"], full["params"])
    assert _leaves_equal(resumed["opt_state"], full["opt_state"])


def test_batches_are_deterministic_per_step(config_path):
    _, tc, _ = train.load_configs(config_path)
    a, b, c = train.make_batch(tc, 5), train.make_batch(tc, 5), train.make_batch(tc, 6)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], c["inputs"])
    # the answer mask covers exactly the target tokens (answer + eos), shifted by one
    for i in range(a["inputs"].shape[0]):
        ans = np.flatnonzero(a["answer_mask"][i])
        assert a["labels"][i, ans[-1]] == 2  # eos closes every target
        assert np.all(a["valid"][i, ans])


def test_export_loads(config_path, tmp_path):
    import kvjax

    cfg, tc, raw = train.load_configs(config_path)
    params = train.init_params(cfg, jax.random.PRNGKey(1))
    train.export_model(tmp_path, cfg, params, raw)
    model = kvjax.load(tmp_path)
    assert model.cfg == cfg and _leaves_equal(model.params, params)
    assert model.decode(model.encode("the sky is blue .", bos=False)) == "the sky is blue."


def test_copy_example_targets_follow_a_unique_cue():
    for seed, random_tokens in itertools.product(range(5), (False, True)):
        prompt, target = train.copy_example(128, np.random.default_rng(seed), random_tokens)
        span = train.copy_span(128)
        # prompt + target fill the context exactly: copy examples pad no batch
        assert len(prompt) + len(target) == 129 and len(target) == span and target[-1] == 2
        body, cue = prompt[1:-1], prompt[-1]
        assert body.count(cue) == 1
        i = body.index(cue)
        assert body[i + 1: i + span] == target[:-1]


def test_recall_example_cues_are_inputs_and_their_followers_targets():
    for seed, random_tokens in itertools.product(range(5), (False, True)):
        prompt, target, mask = train.recall_example(256, np.random.default_rng(seed), random_tokens)
        assert len(prompt) + len(target) == 257 and len(mask) == len(target)
        seq = prompt[-1:] + target  # cue, 3 followers, cue, ...
        q = 256 // 32
        assert len(seq) == q * (train.RECALL_SPAN + 1) and sum(mask) == q * train.RECALL_SPAN
        body, cues = prompt[1:-1], seq[:: train.RECALL_SPAN + 1]
        assert len(set(cues)) == q and all(m == 0 for m in mask[train.RECALL_SPAN:: 4])
        for j, cue in enumerate(cues):
            assert body.count(cue) == 1
            i = body.index(cue)
            assert seq[4 * j + 1: 4 * j + 4] == body[i + 1: i + 4]


def test_repeat_example_is_one_segment_repeated():
    for seed, random_tokens in itertools.product(range(5), (False, True, 64)):
        prompt, target, mask = train.repeat_example(96, np.random.default_rng(seed), random_tokens)
        seq, m = prompt[1:] + target, len(prompt) - 1
        assert len(seq) == 96 and 96 // 8 <= m <= 96 // 2 and len(mask) == len(target)
        assert all(seq[i] == seq[i - m] for i in range(m, 96))
        assert mask == [0] + [1] * (len(target) - 1)  # the wrap-around is not predictable


@pytest.mark.parametrize("suffix, p", [("", 0.5), (":0.1", 0.1)])
def test_mixed_random_tokens_are_digits_with_probability_p(tmp_path, suffix, p):
    tc = _staged(tmp_path, [0, 128, 8, {f"{k}_mixed{suffix}": 1 for k in ("repeat", "recall", "copy")}])
    b = train.make_batch(tc, 0)
    ids = b["inputs"][:, 1:][b["valid"][:, 1:]]
    assert ids.min() >= 4 and abs(np.mean(ids < 14) - p) < 0.1  # ids 4-13 are the digits
    assert not b["context_mask"].any()  # random tokens: no next-token loss


def test_mixed_digit_probability_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"_mixed:1.5: the digit probability must be in \(0, 1\]"):
        train.copy_example(64, np.random.default_rng(0), 1.5)


def test_only_random_tokens_go_without_next_token_loss(tmp_path):
    """Task names have underscores too (niah_single): only the random copy/recall/repeat
    kinds drop the context loss (a bug once dropped it for every task)."""
    for name, lm in (("niah_single", True), ("kv_retrieval", True), ("copy", True),
                     ("recall", True), ("copy_random", False), ("repeat_mixed", False)):
        tc = _staged(tmp_path, [0, 128, 2, {name: 1}])
        assert train.make_batch(tc, 0)["context_mask"].any() == lm, name


def test_recall_in_a_batch_predicts_only_the_followers(tmp_path):
    tc = _staged(tmp_path, [0, 64, 4, {"recall_random": 1}])
    b = train.make_batch(tc, 0)
    assert b["inputs"].shape == (4, 64) and not b["context_mask"].any()
    for i in range(4):
        ans = np.flatnonzero(b["answer_mask"][i])
        assert len(ans) == 2 * train.RECALL_SPAN  # two cues at 64 tokens, 3 followers each
        assert set(b["labels"][i, ans]) <= set(b["inputs"][i, : ans[0]])


def test_a_stage_with_its_own_tasks_replaces_the_mixture(tmp_path):
    tc = _staged(tmp_path, [0, 32, 8, {"copy_random": 1}], [2, 128, 4])
    assert tc.mixture(1) == (("copy_random", 1.0),) and tc.stage(1) == (32, 8)
    assert tc.mixture(2) == tc.tasks and tc.stage(2) == (128, 4)
    b = train.make_batch(tc, 0)
    assert b["inputs"].shape == (8, 32)
    # copy_random at 32 tokens: the 8 target tokens all occur earlier in the sequence
    for i in range(8):
        ans = np.flatnonzero(b["answer_mask"][i])[:-1]  # eos last
        assert set(b["labels"][i, ans]) <= set(b["inputs"][i, : ans[0]])


def test_grow_keeps_the_function():
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in CONFIG["model"].items()})
    params = train.init_params(cfg, jax.random.PRNGKey(0))
    big, big_cfg = train.grow(params, cfg, 5, jax.random.PRNGKey(1))
    assert big_cfg == dataclasses.replace(cfg, num_layers=5)
    assert big["layers"]["q"].shape[0] == 5 and float(abs(big["layers"]["q"][2:]).sum()) > 0
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 24), 3, 1000)
    valid = np.ones((2, 24), bool)
    a = train.forward(params, cfg, tokens, valid, remat=False)
    b = train.forward(big, big_cfg, tokens, valid, remat=False)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)


@pytest.mark.slow  # ~35 s; test_loss_decreases_and_resume_is_identical runs in CI
def test_resume_across_growth_is_identical(tmp_path):
    cfg = {"model": {**CONFIG["model"], "num_layers": 3},
           "train": {**CONFIG["train"], "layers": [[0, 1], [4, 3]]}}
    p = tmp_path / "grow.yaml"
    p.write_text(yaml.safe_dump(cfg))
    full = train.train(p, tmp_path / "a", log_every=1)
    assert full["params"]["layers"]["q"].shape[0] == 3
    for stop in (4, 6):  # a checkpoint at the growth step (saved shallow), one after it
        part = train.train(p, tmp_path / f"b{stop}", steps=stop)
        assert part["params"]["layers"]["q"].shape[0] == (1 if stop == 4 else 3)
        resumed = train.train(p, tmp_path / f"b{stop}")
        assert _leaves_equal(resumed["params"], full["params"])
        assert _leaves_equal(resumed["opt_state"], full["opt_state"])


@pytest.mark.slow  # ~35 s; test_loss_decreases_and_resume_is_identical runs in CI
def test_a_warm_restart_seeded_from_an_export_equals_the_uninterrupted_run(tmp_path):
    """A same-depth phase (`layers` [6, 3, lr]) starts fresh moments and its own schedule,
    so the exported weights of its first step are the whole state: a run seeded from them
    (`--from-export`) reaches the parameters of the run that never stopped."""
    cfg = {"model": {**CONFIG["model"], "num_layers": 3},
           "train": {**CONFIG["train"], "layers": [[0, 1], [4, 3], [6, 3, 3e-3]]}}
    p = tmp_path / "restart.yaml"
    p.write_text(yaml.safe_dump(cfg))
    _, tc, _ = train.load_configs(p)
    assert [tc.phase(s) for s in (3, 4, 5, 6, 7)] == [
        (0, 4, 1e-2), (4, 6, 1e-2), (4, 6, 1e-2), (6, 8, 3e-3), (6, 8, 3e-3)]
    full = train.train(p, tmp_path / "a")
    train.train(p, tmp_path / "b", export=tmp_path / "e6", steps=6, export_early=True)
    assert train.seed_from_export(p, tmp_path / "c", tmp_path / "e6") == 6
    seeded = train.train(p, tmp_path / "c")
    assert _leaves_equal(seeded["params"], full["params"])
    assert _leaves_equal(seeded["opt_state"], full["opt_state"])
    # mid-phase the moments are part of the state: an export of step 5 cannot seed a run
    train.train(p, tmp_path / "d", export=tmp_path / "e5", steps=5, export_early=True)
    with pytest.raises(ValueError, match=r"trained 5 steps.*one of \[4, 6\]"):
        train.seed_from_export(p, tmp_path / "f", tmp_path / "e5")
    with pytest.raises(ValueError, match=r"already holds step 8 >= 6"):
        train.seed_from_export(p, tmp_path / "a", tmp_path / "e6")


def test_a_cycled_stage_alternates_lengths_step_by_step(tmp_path):
    tc = _staged(tmp_path, [0, 96, 8], [2, [128, 256], [4, 2]])
    assert [tc.stage(s) for s in range(6)] == [(96, 8), (96, 8), (128, 4), (256, 2), (128, 4), (256, 2)]
    assert [train.make_batch(tc, s)["inputs"].shape[0] for s in (1, 2, 3)] == [8, 4, 2]
    with pytest.raises(ValueError, match=r"from step 2: \(128, 256\) context lengths and \(4,\) batch"):
        _staged(tmp_path, [0, 96, 8], [2, [128, 256], [4]])


def test_growth_schedule_must_end_at_the_model_depth(tmp_path):
    cfg = {**CONFIG, "train": {**CONFIG["train"], "layers": [[0, 1], [4, 3]]}}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="num_layers=2"):
        train.load_configs(p)


def test_copy_random_over_the_first_n_tokens(tmp_path):
    tc = _staged(tmp_path, [0, 24, 16, {"copy_random:8": 1}])
    b = train.make_batch(tc, 0)
    ids = b["inputs"][:, 1:][b["valid"][:, 1:]]
    assert set(ids.tolist()) <= set(range(14, 22)) and b["inputs"].shape == (16, 24)
    assert not b["context_mask"].any()  # random tokens carry no next-token loss
    with pytest.raises(ValueError, match=r"\*_random:5000: at most 1377"):
        train.copy_example(24, np.random.default_rng(0), 5000)
