"""Filler text generated from a small grammar (no corpus is downloaded).

Why a grammar: the haystack must be plausible enough that a small model learns to skim it,
cheap to make at any length, deterministic given a `numpy.random.Generator`, and exact in
token count. Every word is one token, so a sentence of `n` words plus its period is exactly
`n + 1` tokens, and `sentence(rng, length)` builds a sentence of any requested token length:
a core clause (subject, verb, optional object) grown by adjectives (+1), an adverb (+1),
prepositional phrases (+3/+4/+5) and a subordinate clause (+3/+4), choosing only growth steps
that keep the remaining budget reachable.

`long_text(n_tokens, seed)` is a continuous text of exactly `n_tokens` tokens, for
PG-19-style perplexity of long generation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvjax.tasks import vocab
from kvjax.tasks.tokenizer import render

Sentences = list[list[str]]
MIN_NATURAL, MAX_NATURAL = 5, 18  # natural sentence lengths in tokens (period included)

_VOWELS = frozenset("aeiou")


class _Rand:
    """Uniform draws from a Generator, fetched in blocks: one numpy call per word would make
    the haystack several times slower (training draws many contexts per step)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.buf: list[float] = []

    def random(self) -> float:
        if not self.buf:
            self.buf = self.rng.random(1024).tolist()
        return self.buf.pop()

    def below(self, n: int) -> int:
        return min(int(self.random() * n), n - 1)


def _pick(rng: _Rand, pos: str) -> str:
    words = vocab.haystack_words()[pos]
    return words[rng.below(len(words))]


class _Sentence:
    """A sentence under construction; `grow` adds one expansion of a given size."""

    def __init__(self, rng: _Rand, core: int):
        self.rng = rng
        self.subj_np = core in (3, 5)
        self.transitive = core in (4, 5)
        self.subj_adjs: list[str] = []
        self.obj_adjs: list[str] = []
        self.adverb: str | None = None
        self.tail: list[list[str]] = []  # prepositional phrases and clauses, in order
        self.clause_used = False

    def ones_left(self) -> int:
        """How many more single-token expansions are possible."""
        n = 0 if self.adverb else 1
        if self.subj_np:
            n += 2 - len(self.subj_adjs)
        if self.transitive:
            n += 2 - len(self.obj_adjs)
        return n

    def options(self) -> list[int]:
        return [1] * min(1, self.ones_left()) + [3, 4, 5]

    def grow(self, size: int) -> None:
        rng = self.rng
        if size == 1:
            slots = []
            if self.adverb is None:
                slots.append("adv")
            if self.subj_np and len(self.subj_adjs) < 2:
                slots.append("subj")
            if self.transitive and len(self.obj_adjs) < 2:
                slots.append("obj")
            slot = slots[rng.below(len(slots))]
            if slot == "adv":
                self.adverb = _pick(rng, "adv")
            else:
                adjs = self.subj_adjs if slot == "subj" else self.obj_adjs
                adjs.append(_fresh_adj(rng, adjs))
        elif size in (3, 4) and not self.clause_used and rng.random() < 0.3:
            self.clause_used = True
            clause = [_pick(rng, "conj"), _pick(rng, "subj"), _pick(rng, "verb_i")]
            if size == 4:
                clause.append(_pick(rng, "adv"))
            self.tail.append(clause)
        else:  # prepositional phrase: prep det [adj [adj]] noun
            adjs: list[str] = []
            for _ in range(size - 3):
                adjs.append(_fresh_adj(rng, adjs))
            self.tail.append([_pick(rng, "prep"), *_np(rng, adjs)])

    def tokens(self) -> list[str]:
        rng = self.rng
        subj = _np(rng, self.subj_adjs) if self.subj_np else [_pick(rng, "subj")]
        out = subj + [_pick(rng, "verb_t" if self.transitive else "verb_i")]
        if self.transitive:
            out += _np(rng, self.obj_adjs)
        if self.adverb:
            out.append(self.adverb)
        for part in self.tail:
            out += part
        return out + ["."]


def _fresh_adj(rng: _Rand, taken: list[str]) -> str:
    """An adjective not already in the noun phrase ("the messy messy crowd" reads badly)."""
    while True:
        adj = _pick(rng, "adj")
        if adj not in taken:
            return adj


def _np(rng: _Rand, adjs: list[str]) -> list[str]:
    """Noun phrase: determiner, adjectives, noun ("a" becomes "an" before a vowel)."""
    det = _pick(rng, "det")
    words = [*adjs, _pick(rng, "noun")]
    if det == "a" and words[0][0] in _VOWELS:
        det = "an"
    return [det, *words]


_CORES = (2, 3, 4, 5)  # pron+verb, det+noun+verb, pron+verb+det+noun, det+noun+verb+det+noun
_CORE_ONES = {2: 1, 3: 3, 4: 3, 5: 5}  # single-token expansions each core allows


def sentence(rng: np.random.Generator | _Rand, length: int) -> list[str]:
    """One sentence of exactly `length` tokens (its period included); 1-2 tokens give an
    interjection ("yes", "indeed .")."""
    if not isinstance(rng, _Rand):
        rng = _Rand(rng)
    if length <= 0:
        return []
    if length <= 2:
        return [_pick(rng, "interj"), "."][:length]
    budget = length - 1

    def reachable(rem: int, ones: int) -> bool:
        return rem == 0 or rem >= 3 or rem <= ones

    cores = [c for c in _CORES if c <= budget and reachable(budget - c, _CORE_ONES[c])]
    core = cores[rng.below(len(cores))]
    s = _Sentence(rng, core)
    rem = budget - core
    while rem > 0:
        ok = []
        for size in s.options():
            if size > rem:
                continue
            ones_after = s.ones_left() - (size == 1)
            if reachable(rem - size, ones_after):
                ok.append(size)
        size = ok[rng.below(len(ok))]
        s.grow(size)
        rem -= size
    out = s.tokens()
    assert len(out) == length, (len(out), length)
    return out


def grammar_sentences(rng: np.random.Generator, n_tokens: int) -> Sentences:
    """Sentences totalling exactly `n_tokens` tokens, natural lengths in
    [MIN_NATURAL, MAX_NATURAL]; only a whole haystack shorter than MIN_NATURAL is tiny."""
    out: Sentences = []
    left = n_tokens
    src = _Rand(rng)
    while left > 0:
        if left <= MAX_NATURAL:
            n = left
        else:
            hi = min(MAX_NATURAL, left - MIN_NATURAL)
            n = MIN_NATURAL + src.below(hi - MIN_NATURAL + 1)
        out.append(sentence(src, n))
        left -= n
    return out


# The classic passkey filler (Mohtashami & Jaggi 2023), repeated.
REPEAT_FILLER: tuple[tuple[str, ...], ...] = tuple(
    tuple(s.split())
    for s in (
        "the grass is green .",
        "the sky is blue .",
        "the sun is yellow .",
        "here we go .",
        "there and back again .",
    )
)


def repeat_sentences(rng: np.random.Generator, n_tokens: int) -> Sentences:
    """The passkey filler cycled to exactly `n_tokens` tokens. Only the end is adjusted: the
    last sentence is cut short (keeping its period), or, when 1-2 tokens are left, the one
    before it ends with "again" ("here we go again again.")."""
    del rng  # deterministic text; the signature matches grammar_sentences
    out: Sentences = []
    left, i = n_tokens, 0
    while left > 0:
        s = list(REPEAT_FILLER[i % len(REPEAT_FILLER)])
        if len(s) > left:
            if left >= 3 or not out:
                s = (s[: left - 1] + ["."]) if left >= 2 else ["."]
            else:
                out[-1][-1:] = ["again"] * left + ["."]
                break
        out.append(s)
        left -= len(s)
        i += 1
    return out


Filler = Callable[[np.random.Generator, int], Sentences]


def tokens(rng: np.random.Generator, n_tokens: int) -> list[str]:
    """A continuous grammar haystack of exactly `n_tokens` tokens."""
    return [t for s in grammar_sentences(rng, n_tokens) for t in s]


def long_text(n_tokens: int, seed: int = 0) -> str:
    """Continuous filler text of exactly `n_tokens` tokens (default tokenizer, no BOS)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens={n_tokens} must be >= 0")
    return render(tokens(np.random.default_rng([seed, 0x4A7]), n_tokens))
