"""Scorers for the synthetic tasks and for RULER files.

Synthetic tasks use RULER's `string_match_all` (fraction of answer strings found) made robust
to how a prediction was detokenised: text is lowercased, whitespace collapsed, digit runs
joined ("4 8 2 1" -> "4821") and spaces around `-` `/` removed, and matches are word-bounded
so that "12" is not found inside "123" (nor "1234" inside "1234-5678").

`ruler_string_match_all` / `ruler_string_match_part` are RULER's own (plain case-insensitive
substring), for scoring RULER's published files exactly as RULER does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_DIGIT_GAP = re.compile(r"(?<=\d)\s+(?=\d)")
_JOINER = re.compile(r"\s*([-/])\s*")
_SPACE = re.compile(r"\s+")
_CONTROL = re.compile(r"[\x00-\x1f]")


def normalize(text: str) -> str:
    """Lowercase, digit runs joined, no spaces around `-` `/`, single spaces."""
    text = _DIGIT_GAP.sub("", text.lower())
    text = _JOINER.sub(r"\1", text)
    return _SPACE.sub(" ", text).strip()


def contains(prediction: str, item: str) -> bool:
    """Word-bounded containment of `item` in `prediction`, both normalised."""
    needle = normalize(item)
    if not needle:
        return False
    pattern = r"(?<![\w-])" + re.escape(needle) + r"(?![\w-])"
    return re.search(pattern, normalize(prediction)) is not None


def string_match_all(prediction: str, answer: Sequence[str]) -> float:
    """Fraction of answer strings present in the prediction (RULER's string_match_all)."""
    if not answer:
        raise ValueError("empty answer list")
    return sum(contains(prediction, a) for a in answer) / len(answer)


def exact_contains(prediction: str, answer: Sequence[str]) -> float:
    """1.0 if every answer string is present, else 0.0 (single-needle tasks)."""
    if not answer:
        raise ValueError("empty answer list")
    return float(all(contains(prediction, a) for a in answer))


def _ruler_clean(prediction: str) -> str:
    # RULER's postprocess_pred: control characters become newlines, then strip
    return _CONTROL.sub("\n", prediction).strip().lower()


def ruler_string_match_all(prediction: str, answer: Sequence[str]) -> float:
    """RULER's string_match_all for one sample, in [0, 1]."""
    pred = _ruler_clean(prediction)
    return sum(r.lower() in pred for r in answer) / len(answer)


def ruler_string_match_part(prediction: str, answer: Sequence[str]) -> float:
    """RULER's string_match_part (QA tasks): 1.0 if any reference is present."""
    pred = _ruler_clean(prediction)
    return float(max(r.lower() in pred for r in answer))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "exact_contains": exact_contains,
    "ruler_string_match_all": ruler_string_match_all,
    "ruler_string_match_part": ruler_string_match_part,
}
