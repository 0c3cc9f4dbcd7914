"""The public Python API: load, generate, compress (docs/design.md, "Public contract")."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import jax.numpy as jnp

from kvjax import engine
from kvjax.compress.method import Method
from kvjax.config import ModelConfig
from kvjax.models.checkpoint import load_hf
from kvjax.pallas.dispatch import Kernels

BUNDLED_DIR = Path(__file__).resolve().parent / "assets"
BUNDLED = ("tiny-retrieval",)


@dataclasses.dataclass
class Model:
    cfg: ModelConfig
    params: dict
    name: str
    path: Path | None = None
    tokenizer: Any = None  # a `tokenizers.Tokenizer`, or None for token-id-only use

    def encode(self, text: str, bos: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer: pass token ids instead of text")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        b = self.cfg.bos_token_id
        return [b, *ids] if bos and b is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer to decode with")
        return _decoder(self.tokenizer)(list(ids))


def _decoder(tok) -> Callable[[list[int]], str]:
    from kvjax.tasks import tokenizer as task_tok

    if task_tok.is_task_tokenizer(tok):
        return lambda ids: task_tok.decode(tok, ids)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def model_dir(name_or_path: str | Path) -> Path:
    """The checkpoint directory of a bundled model's name, or the directory given."""
    path = Path(name_or_path)
    if str(name_or_path) in BUNDLED:
        path = BUNDLED_DIR / str(name_or_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"bundled model {name_or_path!r} is not in this checkout ({path}); "
                f"train it with `python -m kvjax.train` (see MODEL.md)")
    elif not path.is_dir():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither a bundled model {BUNDLED} nor a local "
            f"checkpoint directory")
    return path


def load(name_or_path: str | Path = "tiny-retrieval", dtype=jnp.float32) -> Model:
    """The bundled model by name, or a local HF checkpoint directory (no network)."""
    path = model_dir(name_or_path)
    cfg, params = load_hf(path, dtype)
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return Model(cfg, params, path.name, path, tokenizer)


@dataclasses.dataclass
class Result:
    text: str | list[str]
    tokens: list[int] | list[list[int]]
    stats: dict


def _ids(model: Model, x, bos: bool) -> list[int]:
    return model.encode(x, bos=bos) if isinstance(x, str) else [int(t) for t in x]


def _batch(model: Model, prompt, bos: bool) -> tuple[list[list[int]], bool]:
    """Normalise str | ids | list of those into a batch; say whether it was a single prompt."""
    if isinstance(prompt, str) or (len(prompt) and isinstance(prompt[0], (int,))) or (
            hasattr(prompt, "ndim") and prompt.ndim == 1):
        return [_ids(model, prompt, bos)], True
    return [_ids(model, p, bos) for p in prompt], False


def generate(
    model: Model,
    prompt,
    method: Method | None = None,
    *,
    question=None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    kernels: Kernels = Kernels(),
) -> Result:
    """Compress the prompt with `method` and generate.

    question=None: question-aware (the prompt holds context and question); otherwise the
    prompt is compressed alone and `question` is prefilled on top (context-only).
    """
    prompts, single = _batch(model, prompt, bos=True)
    questions = None
    if question is not None:
        questions, _ = _batch(model, question, bos=False)
        if len(questions) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(questions)} questions")
    gen = engine.run(model.params, model.cfg, prompts, method, questions=questions,
                     max_new_tokens=max_new_tokens,
                     sampling=engine.Sampling(temperature, top_p),
                     stop_ids=None if stop_ids is None else tuple(stop_ids), seed=seed,
                     kernels=kernels)
    texts = [model.decode(t) for t in gen.tokens] if model.tokenizer is not None else None
    if single:
        return Result(texts[0] if texts else None, gen.tokens[0], gen.stats)
    return Result(texts, gen.tokens, gen.stats)


def compress(model: Model, prompt, method: Method | None = None, question=None,
             kernels: Kernels = Kernels()):
    """Prefill and compress only (no decoding): (cache, stats). Scenarios as in `generate`."""
    prompts, _ = _batch(model, prompt, bos=True)
    questions = None if question is None else _batch(model, question, bos=False)[0]
    gen = engine.run(model.params, model.cfg, prompts, method, questions=questions,
                     max_new_tokens=0, kernels=kernels)
    return gen.cache, gen.stats
