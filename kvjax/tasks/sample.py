"""`Sample`: one evaluation prompt, split into context and question.

The split is what the two evaluation scenarios need:
- question-aware: `prompt` (= `context + sep + question`; `sep` is one space except where a
  benchmark file's own text joins them otherwise) is prefilled and compressed whole;
- context-only: `context` is prefilled and compressed, then `question` is prefilled on top of
  the compressed cache. For the synthetic tasks `encode(context) + encode(question) ==
  encode(prompt)`, so both scenarios see exactly the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    context: str
    question: str
    answer: list[str]  # every string the prediction must contain (or the references)
    target: str  # the exact text a model is trained to write after the question
    depth: float | None  # relative position of the (first) needle; None for aggregation
    max_new_tokens: int  # enough to write `target` and `<eos>`
    metric: str = "string_match_all"
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    sep: str = " "  # what joins context and question in `prompt`
    # chat: whether `--chat-template` may wrap the prompt (LongBench leaves its few-shot and
    # code datasets unwrapped; a file whose text already holds chat markup is not wrapped)
    chat: bool = True

    @property
    def prompt(self) -> str:
        return self.context + self.sep + self.question
