"""Make the tokenizer fixtures of tests/test_gguf.py from llama.cpp's vocabulary tests.

llama.cpp keeps, per pre-tokenizer, a tokenizer-only GGUF file (`models/ggml-vocab-NAME.gguf`)
and 47 test strings (`.gguf.inp`) with the ids the ORIGINAL Hugging Face tokenizer gives
them (`.gguf.out`, written by its `convert_hf_to_gguf_update.py`). The GGUF files are 2-8 MB
each; this script keeps what those 47 strings can reach and writes it xz-compressed:

- every merge (a, b) whose result a + b occurs in the byte-level rendering of a test string
  (no other merge can fire inside a pre-token of those strings);
- every token that occurs there, and every control or user-defined token;
- the other tokens are renamed `<pruned:ID>` (unreachable: no merge makes them), so that
  every id is unchanged.

The pruned file must give the same ids as the whole one on every string (checked here), and
both must equal `.out`, else nothing is written.

    python scripts/prune_gguf_vocab.py DIR NAME [NAME ...]   # DIR holds llama.cpp's files
"""

from __future__ import annotations

import lzma
import tempfile
import unicodedata
from pathlib import Path

import gguf

from kvjax import tokenization
from kvjax.models.gguf import field, reader

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf_vocab"
KEYS = ("bos", "eos", "unknown", "seperator", "padding")


def _byte_level(text: str) -> str:
    """`text` in GPT-2's byte-to-unicode alphabet (what byte-level BPE merges work on)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    return "".join(table[b] for b in text.encode("utf-8"))


def cases(src: Path) -> list[tuple[str, list[int]]]:
    inp = src.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    out = src.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(inp, out)]


def prune(src: Path, dst: Path) -> None:
    r = reader(src)
    tests = cases(src)
    seen = "\n".join(_byte_level(t) + "\n" + _byte_level(unicodedata.normalize("NFC", t))
                     for t, _ in tests)
    tokens, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    keep = [t if (k != 1 or t in seen) else f"<pruned:{i}>"
            for i, (t, k) in enumerate(zip(tokens, types))]
    merges = [m for m in field(r, "tokenizer.ggml.merges") if m.replace(" ", "", 1) in seen]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "v.gguf"
        w = gguf.GGUFWriter(str(tmp), field(r, "general.architecture"))
        w.add_tokenizer_model(field(r, "tokenizer.ggml.model"))
        w.add_tokenizer_pre(field(r, "tokenizer.ggml.pre"))
        w.add_token_list(keep)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for k in KEYS:
            if (v := field(r, f"tokenizer.ggml.{k}_token_id")) is not None:
                w.add_uint32(f"tokenizer.ggml.{k}_token_id", v)
        w.add_add_bos_token(bool(field(r, "tokenizer.ggml.add_bos_token", False)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        whole, _ = tokenization.from_gguf(r, src)
        pruned, _ = tokenization.from_gguf(reader(tmp), tmp)
        for text, want in tests:
            a = whole.encode(text, add_special_tokens=False).ids
            b = pruned.encode(text, add_special_tokens=False).ids
            if not a == b == want:
                raise SystemExit(f"{src.name}: {text!r}: whole {a}, pruned {b}, reference {want}")
        dst.write_bytes(lzma.compress(tmp.read_bytes(), preset=9))
    dst.with_suffix("").with_suffix(".inp").write_text(
        src.with_suffix(".gguf.inp").read_text(encoding="utf-8"), encoding="utf-8")
    dst.with_suffix("").with_suffix(".out").write_text(
        src.with_suffix(".gguf.out").read_text(encoding="utf-8"), encoding="utf-8")
    print(f"{dst.name}: {len(merges)} of {len(field(r, 'tokenizer.ggml.merges'))} merges, "
          f"{dst.stat().st_size} bytes; {len(tests)} strings equal the reference")


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="the folder holding llama.cpp's ggml-vocab-NAME.gguf"
                   "(.inp, .out) files")
    p.add_argument("names", nargs="+", help="vocabularies, e.g. llama-bpe qwen2 starcoder gpt-2")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in a.names:
        prune(a.dir / f"ggml-vocab-{name}.gguf", OUT / f"{name}.gguf.xz")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
