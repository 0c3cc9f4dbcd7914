"""LongBench's per-dataset metrics, re-implemented without extra dependencies.

Faithful to LongBench's definitions (qa F1 with its answer normalisation, classification,
retrieval and count scores, max over references, first line only for few-shot datasets),
with three documented substitutions:
- rouge-L: sentence-level LCS F-measure with beta = P / R (the formula of the `rouge` package
  LongBench uses) on whitespace tokens; that package's summary-level variant splits sentences
  first, so long multi-sentence summaries can score slightly differently.
- Chinese (`*_zh`): characters instead of jieba words.
- code similarity: `difflib.SequenceMatcher.ratio()` instead of `fuzzywuzzy.fuzz.ratio`
  (the same Ratcliff-Obershelp ratio, without fuzzywuzzy's rounding to whole percent).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCT = set(string.punctuation)
_ZH_PUNCT = _PUNCT | set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD normalisation: lowercase, drop punctuation and articles, one space."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop (Chinese and ASCII) punctuation and all whitespace."""
    return "".join(ch for ch in s.lower() if ch not in _ZH_PUNCT and not ch.isspace())


def f1_tokens(prediction: Sequence[str], reference: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str, **_) -> float:
    return f1_tokens(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(reference)))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_tokens(hyp: Sequence[str], ref: Sequence[str]) -> float:
    if not hyp or not ref:
        return 0.0
    lcs = lcs_length(hyp, ref)
    if lcs == 0:
        return 0.0
    r, p = lcs / len(ref), lcs / len(hyp)
    beta = p / (r + 1e-12)
    return (1 + beta**2) * r * p / (r + beta**2 * p + 1e-12)


def rouge_l(prediction: str, reference: str, **_) -> float:
    return rouge_l_tokens(prediction.split(), reference.split())


def rouge_l_zh(prediction: str, reference: str, **_) -> float:
    def chars(s: str) -> list[str]:
        return [c for c in s if not c.isspace()]

    return rouge_l_tokens(chars(prediction), chars(reference))


def classification(prediction: str, reference: str, all_classes: Sequence[str] = (), **_) -> float:
    """1 / (number of class names in the prediction) if the right one is among them; class
    names that are substrings of the right one do not count against it."""
    matched = [c for c in all_classes if c in prediction]
    matched = [c for c in matched if not (c in reference and c != reference)]
    return 1.0 / len(matched) if reference in matched else 0.0


def _id_fraction(prediction: str, reference: str, pattern: str) -> float:
    found = re.findall(pattern, reference)
    if not found:
        return 0.0
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == found[0] for n in numbers) / len(numbers)


def retrieval(prediction: str, reference: str, **_) -> float:
    """Fraction of the numbers in the prediction equal to the paragraph id ("Paragraph 12")."""
    return _id_fraction(prediction, reference, r"Paragraph (\d+)")


def retrieval_zh(prediction: str, reference: str, **_) -> float:
    return _id_fraction(prediction, reference, r"段落(\d+)")


def count(prediction: str, reference: str, **_) -> float:
    """Fraction of the numbers in the prediction equal to the reference count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(reference) for n in numbers) / len(numbers)


def code_sim(prediction: str, reference: str, **_) -> float:
    """Similarity of the first line of code (skipping comment and fence lines) to the reference."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return difflib.SequenceMatcher(None, line, reference).ratio()


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge": rouge_l,
    "rouge_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}

DATASET_METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_zh",
    "gov_report": "rouge",
    "qmsum": "rouge",
    "multi_news": "rouge",
    "vcsum": "rouge_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

# LongBench's generation budgets (dataset2maxlen).
# the datasets LongBench's pred.py leaves out of the chat template (few-shot and code
# completion: the prompt is a continuation, not a request)
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

DATASET_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512,
    "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

# Few-shot datasets: LongBench scores only the first line of the prediction.
FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def longbench_score(
    dataset: str, metric: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] = ()
) -> float:
    """One sample's score in [0, 1]: the best over references, as LongBench does."""
    if dataset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRICS[metric]
    return max((fn(prediction, r, all_classes=all_classes or ()) for r in references), default=0.0)
