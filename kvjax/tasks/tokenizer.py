"""The tiny word-level tokenizer the task model is trained with.

Why word level: a ~5M-parameter model cannot afford to spend capacity on sub-word spelling.
Every word of the shipped lists is one token, every digit is one token (numbers are copied
digit by digit, as with the Qwen2/Qwen3 and Llama 2 tokenizers; Llama 3's groups up to three
digits), and punctuation marks are single tokens.

Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then the digits 0..9, then the punctuation
marks of `vocab.PUNCTUATION`, then every word (sorted). Encoding adds NO special token: the
engine prepends `<bos>` itself (`bos_token_id` = 1), and training appends `<eos>` (2).

`render(tokens)` writes tokens as natural text (digit runs joined, no space before
punctuation); `decode(tokenizer, ids)` is `render` of the ids' tokens. Task text is always
produced by `render`, so `decode(encode(text)) == text` holds exactly on every task string.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from kvjax.tasks import vocab

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_SPECIAL = frozenset(vocab.SPECIAL_TOKENS)
_NO_SPACE_BEFORE = frozenset(".,:;?!)")
_NO_SPACE_AFTER = frozenset("(")
_JOINERS = frozenset("-/")  # no space on either side: "1234-5678"


def vocabulary() -> dict[str, int]:
    """Token -> id, in the documented deterministic order."""
    tokens = [*vocab.SPECIAL_TOKENS, *vocab.DIGITS, *vocab.PUNCTUATION, *vocab.all_words()]
    if len(set(tokens)) != len(tokens):
        raise ValueError("duplicate token in the task vocabulary")
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer() -> Tokenizer:
    """A fresh `tokenizers.Tokenizer` (WordLevel); identical on every call."""
    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation("isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    # Already in the vocabulary with ids 0..3; this marks them special (skipped on decode,
    # never split by the pre-tokenizer).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab.SPECIAL_TOKENS])
    return tok


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The shared default tokenizer (built once per process)."""
    return build_tokenizer()


@functools.cache
def _token_to_id() -> dict[str, int]:
    return vocabulary()


def token_ids(tokens: Iterable[str]) -> list[int]:
    """Ids of already-split tokens (what the task generators produce), without re-tokenising."""
    table = _token_to_id()
    return [table.get(t, UNK_ID) for t in tokens]


def encode(text: str, tokenizer: Tokenizer | None = None) -> list[int]:
    """Token ids of `text`, no special tokens added."""
    tok = tokenizer or default_tokenizer()
    return tok.encode(text, add_special_tokens=False).ids


def count_tokens(text: str) -> int:
    """Number of tokens of `text` with the default tokenizer (no BOS)."""
    return len(encode(text))


def render(tokens: Sequence[str]) -> str:
    """Natural text for a token sequence: single spaces, except inside digit runs
    ("4821"), before `. , : ; ? ! )`, after `(`, and around `-` and `/`."""
    out: list[str] = []
    prev = None
    for t in tokens:
        if prev is not None:
            glue = (
                (t.isdigit() and prev.isdigit())
                or t in _NO_SPACE_BEFORE
                or prev in _NO_SPACE_AFTER
                or t in _JOINERS
                or prev in _JOINERS
            )
            if not glue:
                out.append(" ")
        out.append(t)
        prev = t
    return "".join(out)


def decode(tokenizer: Any, ids: Iterable[int]) -> str:
    """Render ids as natural text, dropping special tokens. Works with a `tokenizers.Tokenizer`
    or a `transformers` fast tokenizer."""
    ids = [int(i) for i in ids]
    if hasattr(tokenizer, "id_to_token"):
        tokens = [tokenizer.id_to_token(i) for i in ids]
    else:
        tokens = tokenizer.convert_ids_to_tokens(ids)
    return render([t for t in tokens if t is not None and t not in _SPECIAL])


def is_task_tokenizer(tokenizer: Any) -> bool:
    """True for a `tokenizers.Tokenizer` laid out like ours (WordLevel, `<bos>`=1, `<eos>`=2,
    digit tokens), whose text should be decoded with `decode` rather than space-joined."""
    try:
        model = tokenizer.model
        return (
            type(model).__name__ == "WordLevel"
            and tokenizer.token_to_id("<bos>") == BOS_ID
            and tokenizer.token_to_id("<eos>") == EOS_ID
            and tokenizer.token_to_id("0") is not None
        )
    except AttributeError:
        return False


def save_tokenizer(directory: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` so that
    `transformers.AutoTokenizer.from_pretrained(directory)` loads it (as a
    `PreTrainedTokenizerFast`; note it does not add `<bos>` by itself either)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_tokenizer()).save(str(directory / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "padding_side": "right",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return directory


def load_tokenizer(directory: str | Path | None = None) -> Tokenizer:
    """The tokenizer saved in `directory` (its `tokenizer.json`), or the default one if None."""
    if directory is None:
        return build_tokenizer()
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
