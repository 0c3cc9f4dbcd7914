"""Llama-3-style and Qwen2-style tokenizer files, built offline (nothing is downloaded).

Each is a byte-level BPE trained on a few sentences, laid out as the real checkpoints lay
out theirs: the same pre-tokenizer regex, normalizer, decoder, post-processor, added
special tokens, tokenizer_config.json fields and chat template (Llama-3-8B-Instruct's;
Qwen2.5-Instruct's ChatML with its default system prompt), so that
`transformers.AutoTokenizer` reads them as it reads the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, \
    pre_tokenizers, processors, trainers

CORPUS = [
    "The river Elm flows past the town of Norby before it reaches the sea.",
    "Which town does the river Elm flow past? Answer briefly.",
    "The special magic number for quiet-lake is 1234567; remember it.",
    "Some special magic numbers are hidden within the following text.",
    "Read the following text and answer the question after it.\n\nQuestion: Answer:",
    "def area(width, height):\n    return width * height\n",
    "What are all the special magic numbers mentioned in the provided text?",
    "Paragraph 1: The mountain pass is closed in winter. Paragraph 2: the harbor.",
] * 3

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
               r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
    "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _bpe(regex: str, special: list[str], digits_nfc: bool, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    if digits_nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _added(tok: Tokenizer, special: list[str]) -> dict:
    return {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for t in special}


def llama3(path: str | Path, template: bool = True) -> Path:
    """Llama-3-Instruct-style files: <|begin_of_text|> added by the post-processor, the
    eot chat template, eos <|eot_id|>."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _bpe(LLAMA3_REGEX, LLAMA3_SPECIAL, False, 420)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))])])
    tok.save(str(path / "tokenizer.json"))
    config = {"added_tokens_decoder": _added(tok, LLAMA3_SPECIAL), "bos_token": bos,
              "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
              "model_input_names": ["input_ids", "attention_mask"],
              "model_max_length": 1000000000000000019884624838656,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template:
        config["chat_template"] = LLAMA3_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def qwen2(path: str | Path, template: bool = True, **config_extra) -> Path:
    """Qwen2.5-Instruct-style files: no bos (a ByteLevel post-processor only), NFC, ChatML
    template with the default system prompt, eos <|im_end|>."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _bpe(QWEN2_REGEX, QWEN2_SPECIAL, True, 400)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    tok.save(str(path / "tokenizer.json"))
    config = {"add_prefix_space": False, "added_tokens_decoder": _added(tok, QWEN2_SPECIAL),
              "bos_token": None, "clean_up_tokenization_spaces": False,
              "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
              "pad_token": "<|endoftext|>", "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "unk_token": None, **config_extra}
    if template:
        config["chat_template"] = QWEN2_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
