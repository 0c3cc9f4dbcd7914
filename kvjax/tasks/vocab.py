"""The word lists shipped in `kvjax/tasks/data/`, read once.

Everything the tasks can write is drawn from these lists plus `TEMPLATE_WORDS`, so the
tokenizer (which is built from the same lists) never produces `<unk>` on a task string.
"""

from __future__ import annotations

import functools
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DIGITS = tuple("0123456789")
# Punctuation the tasks use, plus a few common marks so ordinary text degrades gracefully.
PUNCTUATION = (".", ",", ":", ";", "?", "!", "-", "=", "(", ")", "'", '"', "/")

# Words that only the task templates use (needles, questions, the passkey filler).
# Cue words (special, magic, pass, key, value, var, answer, ...) are deliberately absent from
# the haystack list so that a needle's cue occurs nowhere else in a context.
TEMPLATE_WORDS = tuple(
    sorted(
        set(
            """
    the special magic number numbers for is are what all answer which variables assigned
    value var key pass remember it here there we go grass green sky blue sun yellow and back
    again important info hidden inside a lot of irrelevant text find memorize i will quiz you
    about information most common words in list frequent coded
    """.split()
        )
    )
)
# Words the grammar writes without drawing them from a list ("a" becomes "an" before a vowel).
GRAMMAR_WORDS = ("an",)


def _read_lines(name: str) -> list[str]:
    lines = (DATA_DIR / name).read_text(encoding="utf-8").splitlines()
    return [w.strip() for w in lines if w.strip() and not w.lstrip().startswith("#")]


@functools.cache
def haystack_words() -> dict[str, tuple[str, ...]]:
    """Part of speech -> words, from the `[section]` groups of `data/words.txt`."""
    groups: dict[str, list[str]] = {}
    section = None
    for line in _read_lines("words.txt"):
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            groups.setdefault(section, [])
        elif section is None:
            raise ValueError(f"words.txt: word {line!r} before any [section] header")
        elif line not in groups[section]:
            groups[section].append(line)
    return {k: tuple(v) for k, v in groups.items()}


@functools.cache
def content_words() -> tuple[str, ...]:
    """Nouns, adjectives, verbs and adverbs of the haystack: the pool for aggregation tasks."""
    g = haystack_words()
    seen: dict[str, None] = {}
    for pos in ("noun", "adj", "verb_t", "verb_i", "adv"):
        for w in g[pos]:
            seen.setdefault(w, None)
    return tuple(seen)


@functools.cache
def keys() -> tuple[str, ...]:
    """Needle keys (niah_*): disjoint from the haystack words."""
    return tuple(dict.fromkeys(_read_lines("keys.txt")))


@functools.cache
def varnames() -> tuple[str, ...]:
    """Variable names (variable_tracking): made-up pseudo-words."""
    return tuple(dict.fromkeys(_read_lines("varnames.txt")))


@functools.cache
def all_words() -> tuple[str, ...]:
    """Every word token of the vocabulary, sorted (deterministic order for token ids)."""
    words = set(TEMPLATE_WORDS) | set(GRAMMAR_WORDS) | set(keys()) | set(varnames())
    for group in haystack_words().values():
        words.update(group)
    return tuple(sorted(words))
