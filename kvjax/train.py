"""Train the bundled model: `python -m kvjax.train --config configs/models/tiny-retrieval.yaml`.

AdamW with warmup + cosine decay (optax), a length curriculum over a mixture of the
synthetic tasks, orbax checkpoints every `checkpoint_every` steps. The data of step `s` is
drawn from `rng([seed, s])`, so a run resumed from a checkpoint continues with exactly the
batches an uninterrupted run would have seen: resuming reproduces the same parameters.
At the end the weights and the tokenizer are exported as an HF checkpoint directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from kvjax.config import ModelConfig
from kvjax.models import attention, transformer
from kvjax.models.checkpoint import param_shapes, save_hf


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 2000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    lm_weight: float = 0.1  # next-token loss on the context (repeated filler teaches copying)
    # (from step, context length, batch size[, task weights]): long contexts come late and in
    # small batches, so a step costs about the same number of tokens throughout; a stage's
    # own task weights replace `tasks` while it lasts. Lists of lengths and batch sizes are
    # cycled step by step: one stage that keeps every length in training
    curriculum: tuple = ((0, 256, 8),)
    tasks: tuple = (("niah_single", 1.0),)
    checkpoint_every: int = 100
    # (from step, layers[, peak lr]): progressive stacking. The model starts shallow
    # (induction forms in a 2-layer model on repeated random segments within a few hundred
    # steps on this CPU, MODEL.md) and is deepened by `grow`; the last is the model's depth.
    # Every entry starts a new optimizer phase (fresh moments, warmup + cosine to the next
    # entry); one at the same depth is a warm restart
    layers: tuple = ()
    remat_from: int = 1024  # rematerialise layers from this context on (below, memory is
    # plentiful and remat only costs a third more compute)

    def stage(self, step: int) -> tuple[int, int]:
        """(context length, batch size) at `step`."""
        start, context, batch = self._stage(step)[:3]
        if isinstance(context, (tuple, list)):
            i = (step - start) % len(context)
            return context[i], batch[i]
        return context, batch

    def mixture(self, step: int) -> tuple:
        """((task, weight), ...) drawn from at `step`."""
        st = self._stage(step)
        return st[3] if len(st) > 3 else self.tasks

    def depth(self, step: int, final: int) -> int:
        """Layers the model has while taking step `step` (`final` once the schedule ends)."""
        return ([x[1] for x in self.layers if x[0] <= step] or [final])[-1]

    def phase(self, step: int) -> tuple[int, int, float]:
        """(first step, last step + 1, peak lr) of the optimizer phase holding `step`."""
        starts = [x for x in self.layers if x[0] <= step] or [(0, 0)]
        ends = [x[0] for x in self.layers if x[0] > step] + [self.steps]
        return starts[-1][0], ends[0], (starts[-1][2:] or (self.lr,))[0]

    def _stage(self, step: int) -> tuple:
        return [c for c in self.curriculum if c[0] <= step][-1]


def load_configs(path: str | Path) -> tuple[ModelConfig, TrainConfig, dict]:
    raw = yaml.safe_load(Path(path).read_text())
    m = raw["model"]
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in m.items()})
    t = dict(raw.get("train", {}))
    weights = lambda d: tuple((k, float(v)) for k, v in d.items())  # noqa: E731
    cycle = lambda x: tuple(x) if isinstance(x, list) else x  # noqa: E731
    t["curriculum"] = tuple(tuple(map(cycle, x[:3])) + tuple(weights(w) for w in x[3:])
                            for x in t.get("curriculum", ((0, 256, 8),)))
    t["tasks"] = weights(t.get("tasks", {"niah_single": 1}))
    t["layers"] = tuple(tuple(x) for x in t.get("layers", ()))
    tc = TrainConfig(**t)
    n = lambda x: len(x) if isinstance(x, tuple) else 0  # noqa: E731
    for c in tc.curriculum:
        if n(c[1]) != n(c[2]):
            raise ValueError(f"curriculum stage from step {c[0]}: {c[1]} context lengths and "
                             f"{c[2]} batch sizes; a cycle needs one batch size per length")
    if tc.layers and tc.layers[-1][1] != cfg.num_layers:
        raise ValueError(f"train.layers ends at {tc.layers[-1][1]} layers, but the model has "
                         f"num_layers={cfg.num_layers}: the last stage must be the model's depth")
    return cfg, tc, raw


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Normal(0, std) matrices (scaled by depth for residual outputs), unit norm weights."""
    shapes = param_shapes(cfg)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, jnp.float32))
        elif "bias" in path:
            out.append(jnp.zeros(shape, jnp.float32))
        else:
            s = std / np.sqrt(2 * cfg.num_layers) if path.endswith(("'o']", "'down']")) else std
            out.append(s * jax.random.normal(k, shape, jnp.float32))
    return jax.tree.unflatten(tree, out)


def grow(params: dict, cfg: ModelConfig, layers: int, key: jax.Array
         ) -> tuple[dict, ModelConfig]:
    """Deepen to `layers` by stacking freshly initialised layers on top whose output
    projections (o, down) are zero: each new layer adds nothing to the residual stream, so
    the grown model computes exactly the same function (progressive stacking, Gong et al.
    2019), and gradients reach the new layers through their zero projections at once."""
    big = dataclasses.replace(cfg, num_layers=layers)
    new = init_params(big, key)["layers"]
    n = cfg.num_layers
    out = {k: v.at[:n].set(params["layers"][k]) for k, v in new.items()}
    out["o"], out["down"] = out["o"].at[n:].set(0.0), out["down"].at[n:].set(0.0)
    return {**params, "layers": out}, big


def forward(params, cfg: ModelConfig, tokens_BT, valid_BT, remat: bool = True):
    """Training forward: the model's layer functions, rematerialised per layer."""
    B, T = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    kpos = jnp.broadcast_to(pos[:, None], (B, cfg.num_kv_heads, T))
    kvalid = jnp.broadcast_to(valid_BT[:, None], (B, cfg.num_kv_heads, T))

    def layer(x, p):
        q, k, v = transformer.qkv(p, cfg, x, pos)
        o = attention.attend_chunked(q, k, v, pos, kpos, kvalid, cfg.sliding_window)
        return transformer.finish_layer(p, cfg, x, o), None

    if remat:
        layer = jax.checkpoint(layer)
    x, _ = jax.lax.scan(layer, params["embed"][tokens_BT], params["layers"])
    return transformer.unembed(params, cfg, x)


def loss_fn(params, cfg, batch, lm_weight, remat=True):
    logits = forward(params, cfg, batch["inputs"], batch["valid"], remat)
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, batch["labels"][..., None], -1)[..., 0]
    ans, ctx = batch["answer_mask"], batch["context_mask"]
    ans_loss = jnp.sum(nll * ans) / jnp.maximum(jnp.sum(ans), 1)
    ctx_loss = jnp.sum(nll * ctx) / jnp.maximum(jnp.sum(ctx), 1)
    acc = jnp.sum((jnp.argmax(logits, -1) == batch["labels"]) * ans) / jnp.maximum(jnp.sum(ans), 1)
    return ans_loss + lm_weight * ctx_loss, {"answer_loss": ans_loss, "context_loss": ctx_loss,
                                             "answer_token_acc": acc}


def copy_span(context_length: int) -> int:
    """Target tokens of a copy example: a quarter of the context up to 64, so that copy
    targets are about as many per batch as the tasks' answer tokens (~5 per example) and
    the induction signal is dense without drowning the answers."""
    return min(max(context_length // 4, 8), 64)


def copy_example(context_length: int, rng: np.random.Generator,
                 random_tokens: int | bool | float = False
                 ) -> tuple[list[int], list[int]]:
    """A training-only task that makes induction heads form early: a haystack, then one of
    its tokens again; the target is the `copy_span` tokens that followed it. Retrieval on
    every task is this circuit (find the cue earlier, copy what came after), and every
    target token here is one step of it, so the signal is dense where the tasks' answers
    are a few tokens per sequence.

    `random_tokens` (task `copy_random`, or `copy_random:N` for the first N): the haystack is
    uniform over the punctuation marks and words instead of generated text, so only the
    repeat is predictable and nothing but induction lowers the loss."""
    from kvjax.tasks.tokenizer import BOS_ID, EOS_ID

    span = copy_span(context_length)
    ids = _haystack(context_length - span - 1, rng, random_tokens)
    (s,) = _unique_cues(ids, 1, len(ids) - span, rng)
    return [BOS_ID, *ids, ids[s]], [*ids[s + 1: s + span], EOS_ID]


RECALL_SPAN = 3
RANDOM_KINDS = ("", "random", "mixed")  # text, random words, random words and digits


def recall_example(context_length: int, rng: np.random.Generator,
                   random_tokens: int | bool | float = False
                   ) -> tuple[list[int], list[int], list[int]]:
    """`copy_example` with many lookups per sequence (task `recall`, `recall_random[:N]`):
    the haystack, then several of its tokens, each followed by the `RECALL_SPAN` tokens that
    followed it there. A copy pays one long-range lookup per `copy_span` targets, the rest
    being the next step of a copy already found; the tasks' answers start with such a
    lookup, and here every fourth token is one. Returns (prompt, target, target mask): the
    cues inside the target are inputs, not predictions (they are drawn at random)."""
    from kvjax.tasks.tokenizer import BOS_ID

    q = max(context_length // 32, 2)  # one lookup per 32 tokens: 64 at 2048
    ids = _haystack(context_length - q * (RECALL_SPAN + 1), rng, random_tokens)
    seq, mask = [], []
    for s in _unique_cues(ids, q, len(ids) - RECALL_SPAN, rng):
        seq += [ids[s], *ids[s + 1: s + 1 + RECALL_SPAN]]
        mask += [0] + [1] * RECALL_SPAN
    return [BOS_ID, *ids, seq[0]], seq[1:], mask[1:]


def repeat_example(context_length: int, rng: np.random.Generator,
                   random_tokens: int | bool | float = False
                   ) -> tuple[list[int], list[int], list[int]]:
    """Induction's textbook task (task `repeat`, `repeat_random[:N]`; Olsson et al. 2022): a
    segment of m tokens, m drawn from [context/8, context/2] per example, repeated until the
    context is full; every token after the first segment is a target. Each bigram recurs
    several times and reliably, the data property that makes induction heads form soonest
    (Aoyama et al. 2025), and with m varying no fixed offset does the job. Returns (prompt,
    target, target mask) as `recall_example`."""
    from kvjax.tasks.tokenizer import BOS_ID

    m = int(rng.integers(max(context_length // 8, 2), context_length // 2 + 1))
    seg = _haystack(m, rng, random_tokens)
    seq = (seg * (-(-context_length // m)))[:context_length]
    # the first repeated token follows nothing seen before: not a target
    return [BOS_ID, *seg], seq[m:], [0] + [1] * (context_length - m - 1)


def _haystack(n: int, rng: np.random.Generator, random_tokens: int | bool | float) -> list[int]:
    """`n` token ids: generated text, or uniform over the first `random_tokens` ids after
    the digits (all punctuation marks and words when True), or (a float p, tasks
    `*_mixed[:p]`, p = 1/2 by default) each a digit with probability p, else any
    punctuation mark or word: the tasks' values are digit strings, and digits that no
    random task shows end up with one shared embedding (MODEL.md)."""
    from kvjax.tasks import haystack, vocab
    from kvjax.tasks.tokenizer import token_ids, vocabulary

    if not random_tokens:
        return token_ids(haystack.tokens(rng, n))
    first = len(vocab.SPECIAL_TOKENS) + len(vocab.DIGITS)
    if isinstance(random_tokens, float):
        if not 0.0 < random_tokens <= 1.0:
            raise ValueError(f"*_mixed:{random_tokens}: the digit probability must be in (0, 1]")
        ids = rng.integers(first, len(vocabulary()), n)
        digit = rng.random(n) < random_tokens
        ids[digit] = rng.integers(len(vocab.SPECIAL_TOKENS), first, int(digit.sum()))
        return ids.tolist()
    top = len(vocabulary()) if random_tokens is True else first + int(random_tokens)
    if top > len(vocabulary()):
        raise ValueError(f"*_random:{random_tokens}: at most "
                         f"{len(vocabulary()) - first} tokens (punctuation and words)")
    return rng.integers(first, top, n).tolist()


def _unique_cues(ids: list[int], q: int, last: int, rng: np.random.Generator) -> list[int]:
    """`q` distinct positions below `last` whose tokens occur once in `ids` (so that what
    follows each is unambiguous), drawn one by one (the draws of the committed recipe's
    `copy_example`, q = 1, stay as they were); any position where there are too few."""
    cand = np.flatnonzero(np.bincount(ids)[np.asarray(ids[:last], np.int64)] == 1)
    out: list[int] = []
    for _ in range(q):
        out.append(int(rng.choice(cand)) if len(cand) else int(rng.integers(0, last)))
        cand = cand[cand != out[-1]]
    return out


def make_batch(tc: TrainConfig, step: int) -> dict:
    """The batch of `step`: deterministic in (seed, step), independent of earlier steps."""
    from kvjax import tasks

    context, batch_size = tc.stage(step)
    rng = np.random.default_rng([tc.seed, step])
    names, w = zip(*tc.mixture(step))
    w = np.array(w)
    seqs = []
    for _ in range(batch_size):
        name = names[rng.choice(len(names), p=w / w.sum())]
        kind, _, n_words = name.partition(":")
        base, _, rand = kind.partition("_")
        mask, lm = None, True
        if base in ("copy", "recall", "repeat") and rand in RANDOM_KINDS:
            random_tokens = (float(n_words or 0.5) if rand == "mixed"
                             else int(n_words or 0) or rand == "random")
            # no next-token loss on random tokens: their only lesson is a false unigram law
            lm = not rand
            if base == "copy":
                prompt, target = copy_example(context, rng, random_tokens)
            else:
                example = recall_example if base == "recall" else repeat_example
                prompt, target, mask = example(context, rng, random_tokens)
        else:
            prompt, target = tasks.training_example(name, context, rng)
        seqs.append((prompt, target, lm, [1] * len(target) if mask is None else mask))
    T = max(len(p) + len(t) for p, t, _, _ in seqs) - 1
    r = 32 if T > 64 else 8
    T = -(-T // r) * r  # few distinct shapes (few compilations), little padding
    batch = {k: np.zeros((batch_size, T), dt) for k, dt in
             (("inputs", np.int32), ("labels", np.int32), ("valid", bool),
              ("answer_mask", np.float32), ("context_mask", np.float32))}
    for i, (p, t, lm, mask) in enumerate(seqs):
        seq = np.array(p + t, np.int32)
        n = len(seq) - 1
        batch["inputs"][i, :n] = seq[:-1]
        batch["labels"][i, :n] = seq[1:]
        batch["valid"][i, :n] = True
        batch["answer_mask"][i, len(p) - 1: n] = mask  # predict the target tokens
        batch["context_mask"][i, : len(p) - 1] = lm
    return batch


def optimizer(tc: TrainConfig, step: int = 0):
    """AdamW, warmup + cosine over the phase of `step` (`TrainConfig.layers`): each phase
    starts a new schedule (and fresh moments), and every phase ends at the low rate."""
    start, end, lr = tc.phase(step)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, tc.warmup, max(end - start, tc.warmup + 1),
                                               lr * tc.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tc.weight_decay))


def update_fn(cfg: ModelConfig, tc: TrainConfig, opt):
    """The jitted training step `(params, opt_state, batch) -> (params, opt_state, loss, aux)`."""
    @jax.jit
    def update(params, opt_state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, cfg, batch, tc.lm_weight, batch["inputs"].shape[1] >= tc.remat_from)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    return update


def train(config_path: str | Path, workdir: str | Path, export: str | Path | None = None,
          steps: int | None = None, log_every: int = 10, export_early: bool = False) -> dict:
    """Run (or resume) training up to `steps` (default: the config's).

    Exports when the schedule is complete, or at `steps` with `export_early` (an interim
    model: its step is recorded next to the weights).
    """
    import orbax.checkpoint as ocp

    cfg, tc, raw = load_configs(config_path)
    stop = tc.steps if steps is None else min(steps, tc.steps)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    mngr = ocp.CheckpointManager(workdir / "ckpt", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, keep_period=500, save_interval_steps=1))  # + every 500th, to probe
    start = mngr.latest_step() or 0
    final, key = cfg, jax.random.PRNGKey(tc.seed)
    cfg, params, opt_state = restore(mngr, start, final, tc)
    if start:
        print(f"resumed from step {start}")
    opt = optimizer(tc, max(start - 1, 0))
    update = update_fn(cfg, tc, opt)
    log = []
    t0 = time.perf_counter()
    for step in range(start, stop):
        if step and tc.phase(step)[0] == step:
            if tc.depth(step, final.num_layers) != cfg.num_layers:
                params, cfg = grow(params, cfg, tc.depth(step, final.num_layers),
                                   jax.random.fold_in(key, step))
            # fresh moments and a new warmup: the old moments were fitted to a shallower
            # network's gradients or to the end of a decayed schedule (MODEL.md)
            opt = optimizer(tc, step)
            opt_state, update = opt.init(params), update_fn(cfg, tc, opt)
        batch = make_batch(tc, step)
        params, opt_state, loss, aux = update(params, opt_state, batch)
        done = step + 1
        if done % log_every == 0 or done == stop:
            rec = {"step": done, "loss": float(loss), "context": batch["inputs"].shape[1],
                   **{k: float(v) for k, v in aux.items()}, "elapsed_s": time.perf_counter() - t0}
            log.append(rec)
            print(json.dumps(rec), flush=True)
            with open(workdir / "train_log.jsonl", "a") as f:  # as it goes: a run may be cut off
                f.write(json.dumps(rec) + "\n")
        if done % tc.checkpoint_every == 0 or done == stop:
            _save(mngr, done, params, opt_state)
    mngr.wait_until_finished()
    if export and (stop == tc.steps or export_early):
        export_model(export, cfg, params, {**raw, "trained_steps": stop})
    return {"params": params, "opt_state": opt_state, "step": stop, "log": log}


def restore(mngr, step: int, cfg: ModelConfig, tc: TrainConfig) -> tuple[ModelConfig, dict, Any]:
    """(config at the depth of `step`, params, optimizer state) saved after `step` steps
    by the orbax manager `mngr`; the initial state for step 0."""
    import orbax.checkpoint as ocp

    # the depth the checkpoint was saved at: that of its last step
    cfg = dataclasses.replace(cfg, num_layers=tc.depth(max(step - 1, 0), cfg.num_layers))
    params = init_params(cfg, jax.random.PRNGKey(tc.seed))
    opt_state = optimizer(tc, max(step - 1, 0)).init(params)
    if step:
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(
            {"params": params, "opt_state": opt_state})))["state"]
        params, opt_state = state["params"], state["opt_state"]
    return cfg, params, opt_state


def seed_from_export(config_path: str | Path, workdir: str | Path, export: str | Path) -> int:
    """Write the checkpoint a run holds after `trained_steps` steps from an exported model,
    where that step starts an optimizer phase: there the state is the parameters alone (the
    moments start fresh), so resuming from it equals an uninterrupted run. Returns the step.
    This lets a phase added to the schedule start from the shipped weights when the deep
    checkpoints (too large to commit) are gone."""
    import orbax.checkpoint as ocp

    from kvjax.models.checkpoint import load_hf

    cfg, tc, _ = load_configs(config_path)
    step = int(yaml.safe_load((Path(export) / "train_config.yaml").read_text())["trained_steps"])
    if not step or tc.phase(step)[0] != step:
        raise ValueError(f"{export} was trained {step} steps; a run can start from it only at "
                         f"the first step of an optimizer phase, one of "
                         f"{[x[0] for x in tc.layers if x[0]]} (train.layers)")
    got, params = load_hf(export)
    want = dataclasses.replace(cfg, num_layers=tc.depth(step - 1, cfg.num_layers))
    if got != want:
        raise ValueError(f"{export} holds a {got.num_layers}-layer model {got}, but step {step} "
                         f"of {config_path} has {want}")
    mngr = ocp.CheckpointManager(Path(workdir).resolve() / "ckpt")
    if (mngr.latest_step() or 0) >= step:
        raise ValueError(f"{workdir} already holds step {mngr.latest_step()} >= {step}")
    opt_state = optimizer(tc, step - 1).init(params)  # replaced at `step`: a phase starts
    _save(mngr, step, params, opt_state)
    mngr.wait_until_finished()
    return step


def _save(mngr, step: int, params, opt_state) -> None:
    """The checkpoint `restore` reads: params and optimizer state after `step` steps."""
    import orbax.checkpoint as ocp

    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state})))


def export_model(path: str | Path, cfg: ModelConfig, params: dict, raw: dict) -> None:
    """HF checkpoint directory + tokenizer + the training config (for the model card)."""
    from kvjax.tasks.tokenizer import save_tokenizer

    path = Path(path)
    save_hf(path, cfg, params)
    save_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0],
        "pad_token_id": cfg.pad_token_id, "do_sample": False}, indent=2) + "\n")
    (path / "train_config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.train", description=__doc__)
    p.add_argument("--config", default="configs/models/tiny-retrieval.yaml")
    p.add_argument("--workdir", default="runs/tiny-retrieval")
    p.add_argument("--export", default="kvjax/assets/tiny-retrieval")
    p.add_argument("--steps", type=int, default=None, help="stop early at this step (resumable)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--export-early", action="store_true",
                   help="export at --steps even though the schedule is not finished")
    p.add_argument("--from-export", default=None, metavar="DIR",
                   help="first write the checkpoint of the step an exported model was trained "
                        "to (it must start an optimizer phase), then resume from it")
    a = p.parse_args(argv)
    if a.from_export:
        print(f"seeded {a.workdir} at step {seed_from_export(a.config, a.workdir, a.from_export)}")
    train(a.config, a.workdir, a.export, a.steps, a.log_every, a.export_early)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
