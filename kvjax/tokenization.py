"""Text <-> token ids for an HF checkpoint, as `transformers.AutoTokenizer` does it.

Why not call transformers: it is heavy to import, and its tokenizer classes are rebuilt
between versions; what decides the ids is small and lives in the checkpoint's files, so
kvjax reads them itself and `tests/test_hf_fidelity.py` holds it to transformers' output
on Llama-3-style and Qwen2-style files built offline:

- `tokenizer.json` is the pipeline (normalizer, pre-tokenizer, model, decoder, added
  tokens), used as written. (transformers 5 rebuilds the pre-tokenizer of some classes,
  e.g. `Qwen2Tokenizer`, from the class's code; for the checkpoints those classes ship
  with, the two pipelines are the same.)
- Special tokens around a prompt: the post-processor of tokenizer.json (Llama 3's adds
  <|begin_of_text|>, Qwen2's ByteLevel adds nothing; none: nothing). transformers 5 drops
  tokenizer_config.json's `add_bos_token` / `add_eos_token` whenever tokenizer.json exists
  (`PreTrainedTokenizerBase._from_pretrained`), so they are not read here either; in the
  checkpoints that ship both, the two agree (the processor was written from the flags).
- The named special tokens (`bos_token`, `eos_token`, ...) come from
  tokenizer_config.json (or, for files without `added_tokens_decoder`, from
  special_tokens_map.json, which then wins, as in transformers); they are the chat
  template's variables.
- The chat template: `chat_template.jinja` if present, else tokenizer_config.json's
  `chat_template` (a string, or a list of named templates: "default"). Rendered as
  `apply_chat_template(messages, add_generation_prompt=True)` renders it (a sandboxed
  jinja2 environment with trim_blocks and lstrip_blocks, `raise_exception`, `tojson`,
  `strftime_now`), then tokenized without added special tokens, as transformers does.

Splitting a prompt for the context-only scenario (`split_ids`): the whole text is
tokenized once and the ids are cut where the context ends (each token goes to the side
its first character is on), so both scenarios see exactly the same ids.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# marks the end of the context inside a rendered chat; private-use characters that no
# tokenizer and no template sees (removed before tokenizing)
_CUT = "\ue000kvjax-context-ends\ue001"


@dataclasses.dataclass
class TextFormat:
    """What besides `tokenizer.json` decides a checkpoint's ids: its special tokens (by
    name: the chat template's variables), its chat template, and the ids added around one
    sequence (`prefix`, `suffix`: what `add_special_tokens=True` adds)."""

    special_tokens: dict[str, str]
    chat_template: str | None
    template_source: str | None  # the file the template was read from
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    # the tokenizer without its post-processor, for character offsets (`split_ids`)
    offsets: Any = dataclasses.field(default=None, repr=False, compare=False)


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict
    (`{"content": ...}`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(f: Path) -> dict:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{f}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{f}: a JSON object expected, got {type(data).__name__}")
    return data


def load(path: str | Path):
    """(`tokenizers.Tokenizer`, `TextFormat`) of a checkpoint directory holding
    tokenizer.json; (None, None) without one."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not (path / "tokenizer.json").exists():
        return None, None
    try:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises its own Exception type
        raise ValueError(f"{path / 'tokenizer.json'} is not a tokenizers file: {e}") from None
    cfg_file = path / "tokenizer_config.json"
    config = _read_json(cfg_file) if cfg_file.exists() else {}
    special = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token(config.get(k))) is not None}
    map_file = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_file.exists():
        special.update({k: t for k, v in _read_json(map_file).items()
                        if k in SPECIAL_TOKEN_NAMES and (t := _token(v)) is not None})
    template, source = _chat_template(path, config)
    prefix, suffix = _around(tok)
    return tok, TextFormat(special, template, source, prefix, suffix)


# llama.cpp's pre-tokenizer names -> the pipelines of the tokenizers they were made from
# (the regexes are those of the original tokenizer.json files; llama.cpp's `llama-vocab.cpp`
# holds the same ones). docs/gguf.md.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
GGUF_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "llama-bpe", "qwen2", "gpt-2")
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 6 byte, ...)


def _pre_tokenizer(pre: str):
    """(normalizer, pre-tokenizer, BPE ignore_merges) of a llama.cpp pre-tokenizer name."""
    from tokenizers import Regex, normalizers, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if pre in ("smollm", "starcoder", "refact"):  # digits one by one, then GPT-2's split
        return None, pt.Sequence([pt.Digits(individual_digits=True),
                                  pt.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    if pre == "gpt-2":
        return None, pt.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre == "llama-bpe":  # Llama 3: digits in threes; a word in the vocabulary is one token
        split = pt.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False)
        return None, pt.Sequence([split, byte_level]), True
    if pre == "qwen2":
        split = pt.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False)
        return normalizers.NFC(), pt.Sequence([split, byte_level]), False
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                     f"{', '.join(GGUF_PRE_TOKENIZERS)}")


def from_gguf(r, path) -> tuple[Any, TextFormat]:
    """(`tokenizers.Tokenizer`, `TextFormat`) built from a GGUF file's `tokenizer.*`
    metadata (`r`: its `gguf.GGUFReader`): a byte-level BPE of its tokens and merges, the
    pre-tokenizer its `tokenizer.ggml.pre` names, its control tokens as special added
    tokens, BOS / EOS added as its `add_bos_token` / `add_eos_token` flags say, and its chat
    template. transformers' own GGUF tokenizer conversion is not used: for SmolLM2's file
    it builds a tokenizer that turns spaces into <|endoftext|> (docs/gguf.md)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    from kvjax.models.gguf import field

    kind = field(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported; supported: "
                         "'gpt2' (byte-level BPE)")
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = field(r, "tokenizer.ggml.merges")
    types = field(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or merges is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    normalizer, pre, ignore_merges = _pre_tokenizer(field(r, "tokenizer.ggml.pre", "gpt-2"))
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    tok = Tokenizer(bpe)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=k == _GGUF_CONTROL, normalized=False)
                    for t, k in zip(tokens, types) if k in (_GGUF_CONTROL, _GGUF_USER_DEFINED)])
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token",  # GGUF's keys
             "seperator": "sep_token", "padding": "pad_token", "cls": "cls_token",
             "mask": "mask_token"}
    ids = {n: field(r, f"tokenizer.ggml.{n}_token_id") for n in names}
    special = {names[n]: tokens[i] for n, i in ids.items() if i is not None and i < len(tokens)}
    around = [("bos", field(r, "tokenizer.ggml.add_bos_token", False)),
              ("eos", field(r, "tokenizer.ggml.add_eos_token", False))]
    for n, on in around:
        if on and ids[n] is None:
            raise ValueError(f"{path}: tokenizer.ggml.add_{n}_token is set but "
                             f"tokenizer.ggml.{n}_token_id is missing")
    bos = f"{tokens[ids['bos']]} " if around[0][1] else ""
    eos = f" {tokens[ids['eos']]}" if around[1][1] else ""
    if bos or eos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} {bos}$B:1{eos}",
            special_tokens=[(tokens[ids[n]], ids[n]) for n, on in around if on])
    template = field(r, "tokenizer.chat_template")
    prefix, suffix = _around(tok)
    return tok, TextFormat(special, template, f"{path} (tokenizer.chat_template)"
                           if template else None, prefix, suffix)


def _chat_template(path: Path, config: dict) -> tuple[str | None, str | None]:
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: transformers takes "default"
        t = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}.get("default")
    return (t, str(path / "tokenizer_config.json")) if isinstance(t, str) else (None, None)


def _around(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the post-processor puts before and after one sequence."""
    if tok.post_processor is None:
        return (), ()
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i: i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain):])
    raise ValueError("the tokenizer's post-processor changes a sequence's own ids; only "
                     "special tokens around it are supported")


def encode(tok, fmt: TextFormat, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer(text, add_special_tokens=...)["input_ids"]` of transformers."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return [*fmt.prefix, *ids, *fmt.suffix] if add_special_tokens else ids


def special_text(tok, text: str) -> str | None:
    """The first special token written out in `text` (`<|begin_of_text|>`, `<|im_start|>`,
    ...), None when there is none: such a text was already rendered with a chat template or
    given its special tokens (RULER files prepared with a model template)."""
    for t in tok.get_added_tokens_decoder().values():
        if t.special and t.content and t.content in text:
            return t.content
    return None


def split_ids(tok, fmt: TextFormat, text: str, at: int,
              add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """`encode(text)` cut at character `at`: the tokens starting before it (and the
    special tokens in front) and the rest (and those behind)."""
    enc = _offsets_tokenizer(tok, fmt).encode(text, add_special_tokens=False)
    k = sum(1 for start, _ in enc.offsets if start < at)
    ids = enc.ids
    if add_special_tokens:
        return [*fmt.prefix, *ids[:k]], [*ids[k:], *fmt.suffix]
    return ids[:k], ids[k:]


def _offsets_tokenizer(tok, fmt: TextFormat):
    """A copy of `tok` without its post-processor (a ByteLevel processor may trim offsets
    past the spaces), made once and kept on the tokenizer's `fmt`: serialising it costs
    tens of ms for a Llama-3-sized vocabulary, and prompts are split one by one."""
    if fmt.offsets is None:
        from tokenizers import Tokenizer

        fmt.offsets = Tokenizer.from_str(tok.to_str())
        fmt.offsets.post_processor = None
    return fmt.offsets


# ---- chat templates ----------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled as transformers' `_compile_jinja_template` compiles it."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant mask): its
        body, unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(fmt: TextFormat, content: str) -> str:
    """One user message rendered with the generation prompt: `apply_chat_template([{"role":
    "user", "content": content}], add_generation_prompt=True, tokenize=False)`."""
    if fmt.chat_template is None:
        raise ValueError("the checkpoint has no chat template (no chat_template.jinja and no "
                         "'chat_template' in tokenizer_config.json)")
    import jinja2

    try:
        return _compiled(fmt.chat_template).render(
            messages=[{"role": "user", "content": content}], tools=None, documents=None,
            add_generation_prompt=True, **fmt.special_tokens)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template of {fmt.template_source}: {e}") from None


def render_chat_split(fmt: TextFormat, context: str, rest: str) -> tuple[str, int]:
    """(the rendering of the user message `context + rest`, the character where `context`
    ends in it). The template must keep the message's text: a template that rewrites it
    leaves no place to cut, and is refused."""
    marked = render_chat(fmt, context + _CUT + rest)
    text = render_chat(fmt, context + rest)
    if marked.count(_CUT) != 1 or marked.replace(_CUT, "") != text:
        raise ValueError(f"the chat template of {fmt.template_source} rewrites the message "
                         "text, so the context cannot be cut from the question "
                         "(context-only scenario)")
    return text, marked.index(_CUT)


def info(fmt: TextFormat | None, tok: Any) -> dict:
    """What a record keeps of how the text was tokenized."""
    if fmt is None:
        return {}
    return {"prefix_ids": list(fmt.prefix), "suffix_ids": list(fmt.suffix),
            "chat_template": fmt.template_source}
