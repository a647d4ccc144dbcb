#!/usr/bin/env python3
"""Golden token ids for testing the C++ loader of Hugging Face byte-level BPE `tokenizer.json` files.

Developer tool, not run in CI:
    python3 -m pip install tokenizers transformers
    tools/make_tokenizer_golden.py [--data tests/data/hf_tokenizer] [--quiet]

For each tokenizer directory under --data (gpt2/, deepseek_v3/), each holding the real
`tokenizer.json` (and `tokenizer_config.json` where the model ships one), it builds
`transformers.PreTrainedTokenizerFast(tokenizer_file=..., **settings)`, the settings being the
keys of tokenizer_config.json that the constructor takes (AddedToken dicts reduced to their
content; chat_template and tokenizer_class left out), and writes

    <data>/<name>/golden.jsonl   one JSON object per line, UTF-8 (ensure_ascii=False):
        {"text": ..., "ids": [...], "ids_with_special": [...]}
      ids              = tok.encode(text, add_special_tokens=False)
      ids_with_special = tok.encode(text, add_special_tokens=True)   (BOS/EOS as the config says)

The same TEXTS (below) are used for every tokenizer. Added tokens written literally in a text
(e.g. "<|endoftext|>", "<｜begin▁of▁sentence｜>") are matched as added tokens, which is what
transformers and tokenizers do by default (split_special_tokens=False).

As a cross-check the ids are also computed with the plain `tokenizers.Tokenizer.from_file`
(`encode(text, add_special_tokens=False)`); the script stops if the two disagree. It then prints,
per tokenizer, the parts of tokenizer.json a reimplementation has to follow: normalizer,
pre_tokenizer, post_processor and decoder (full JSON), the model's keys other than vocab/merges,
the format of `merges`, and the added tokens (count, first 10 with their flags).

Where the files come from is written in tests/data/hf_tokenizer/README.md.
"""
import argparse
import json
import os
import sys

import tokenizers
import transformers
from transformers import PreTrainedTokenizerFast

NAMES = ("gpt2", "deepseek_v3")


def long_paragraph():
    """A ~2 KB mixed paragraph: prose, numbers, code, CJK, emoji, whitespace runs."""
    parts = [
        "In 1969, Apollo 11 landed on the Moon; 600,000,000 people watched. It's said they'd "
        "never seen anything like it, and they'll remember it. ",
        "The function `def f(x): return x ** 2 + 3.14159 * x` isn't hard, but C++'s "
        "`std::vector<int> v{1, 2, 3};` can't be beaten for speed!!! ",
        "北京是中国的首都，人口约为21,893,095人。東京は日本の首都です。カタカナとひらがな。"
        "서울은 대한민국의 수도입니다. ",
        "Москва — столица России. Ελληνικά γράμματα: αβγδε. العربية لغة جميلة. ",
        "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ❤️ ✨. ",
        "Tabs\tand  double  spaces,\nnewlines\r\nand\n\n\nblank lines. ",
        "Prices: $4.99, €12,50, ¥1000, £3; dates: 2024-12-26, 26/12/2024; times 23:59:59. ",
        "E-mail: someone@example.com; URL: https://www.example.org/a/b?c=d&e=f#g. ",
        "Accents: café, naïve, façade, jalapeño, Zürich, Ærøskøbing, cafe\u0301. ",
        "Numbers: 0 7 42 314 2718 16180 141421 1732050 12345678901234567890. ",
        "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n",
        "    indented line\n        more indented\n\treturn None  \n",
        "“Quoted” ‘text’ — dashes – and … ellipses; «guillemets» and 「括弧」. ",
        "SHOUTING: IT'S THE END OF THE WORLD AS WE KNOW IT, AND I FEEL FINE. ",
        "The end.",
    ]
    text = "".join(parts)
    while len(text.encode("utf-8")) < 2000:
        text += " " + parts[0] + parts[3]
    return text


TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's John's car; they're here, we've seen it, you'll see, he'd go, I'm sure, don't, can't, won't.",
    "IT'S JOHN'S CAR. THEY'RE HERE! WE'VE SEEN, YOU'LL SEE, HE'D GO, I'M SURE, DON'T. It'S mIxEd'S.",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple     spaces   between  words",
    " a single leading space and a single trailing space ",
    "tab\tseparated\tvalues\t\tdouble tab\t",
    "line one\nline two\r\nline three\n\n\nline six\n",
    "trailing whitespace \t \n  \n",
    "\n",
    "\r\n\r\n",
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 12345678901234567890",
    "1234567",
    "pi = 3.14159, e = 2.71828, one million = 1,000,000 = 1_000_000; -42, +7, 0x1F, 1e-9, 50%, v1.2.3",
    "Wait... what?!? Really!!! (yes) [no] {maybe} <tag/> -- --- ;;; ::: ??? !!! @#$%^&*_+=|\\~`",
    "def greet(name: str) -> str:\n    \"\"\"Say hello.\"\"\"\n    if not name:\n        return 'Hello, world!'\n"
    "    return f\"Hello, {name}!\"\n\n\nclass Foo:\n\tpass\n",
    "#include <vector>\n\nint main() {\n    std::vector<int> v{1, 2, 3};\n    for (auto& x : v) {\n"
    "        x *= 2;  // double it\n    }\n    return v.size() > 2 ? 0 : 1;\n}\n",
    "我们今天去北京大学学习自然语言处理。你好，世界！",
    "ひらがなとカタカナと漢字を混ぜた日本語の文章です。東京タワーへ行きました。",
    "コンピューター・プログラミング",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "مرحبا بالعالم! هذه جملة عربية.",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "café, naïve, résumé, jalapeño, Ångström, Straße, œuvre, Øresund, ĳ",
    "cafe\u0301 vs caf\u00e9; n\u0303 vs \u00f1; A\u030a vs \u00c5",
    "I ❤️ emoji 😀🎉👍🏽",
    "👨\u200d👩\u200d👧\u200d👦 family, 🏳️\u200d🌈 flag, 👩🏽\u200d💻 coder",
    "🇺🇸🇯🇵🇨🇳🇩🇪 flags",
    "<｜begin▁of▁sentence｜>hello<｜end▁of▁sentence｜>",
    "<｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> spaced",
    "<think>reasoning</think>answer",
    "",
    " ",
    "\u00a0",
    "a\u00a0b\u3000c",
    "\u3000",
    "zero\u200bwidth\ufeffbom and soft\u00adhyphen",
    "bell\x07 escape\x1b delete\x7f",
    "abc123中文ABCdef456日本語",
    "Visit https://example.com/path?q=1&r=2#frag or mail foo.bar@example.org",
    "“Smart quotes” and ‘single’ — em dash – en dash … ellipsis",
    "नमस्ते दुनिया; สวัสดีชาวโลก",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ================ ----------",
    long_paragraph(),
]

# tokenizer_config.json keys passed to the constructor (the rest are chat/template/class metadata).
CONFIG_KEYS = ("add_bos_token", "add_eos_token", "bos_token", "eos_token", "unk_token", "pad_token",
               "clean_up_tokenization_spaces", "model_max_length", "legacy", "add_prefix_space")


def settings_from_config(path):
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    out = {}
    for k in CONFIG_KEYS:
        if k not in cfg or cfg[k] is None:
            continue
        v = cfg[k]
        if isinstance(v, dict) and v.get("__type") == "AddedToken":
            v = v["content"]
        out[k] = v
    return out


def describe(name, path, cfg_path):
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    print(f"===== {name}: {path} ({os.path.getsize(path)} bytes)")
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding"):
        print(f"{key}: {json.dumps(j.get(key), ensure_ascii=False)}")
    model = j["model"]
    print("model keys (vocab/merges left out):",
          json.dumps({k: v for k, v in model.items() if k not in ("vocab", "merges")}, ensure_ascii=False))
    if "type" not in model:
        print("  note: model has no \"type\" key (old serialisation); tokenizers infers BPE from its fields")
    merges = model["merges"]
    kind = "strings \"a b\"" if isinstance(merges[0], str) else "pairs [\"a\", \"b\"]"
    print(f"vocab: {len(model['vocab'])} entries, ids {min(model['vocab'].values())}..{max(model['vocab'].values())}; "
          f"merges: {len(merges)} as {kind}; first 3: {json.dumps(merges[:3], ensure_ascii=False)}")
    added = j["added_tokens"]
    flags = {}
    for a in added:
        key = tuple((k, a[k]) for k in ("special", "normalized", "lstrip", "rstrip", "single_word"))
        flags[key] = flags.get(key, 0) + 1
    in_vocab = sum(1 for a in added if a["content"] in model["vocab"])
    print(f"added_tokens: {len(added)} (ids {min(a['id'] for a in added)}..{max(a['id'] for a in added)}; "
          f"{in_vocab} of them also in model.vocab)")
    for key, n in sorted(flags.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d} x {dict(key)}")
    for a in added[:10]:
        print("  ", json.dumps(a, ensure_ascii=False))
    if len(added) > 10:
        print("   ...")
        for a in added[-3:]:
            print("  ", json.dumps(a, ensure_ascii=False))
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        print("tokenizer_config.json:",
              json.dumps({k: v for k, v in cfg.items() if k != "chat_template"}, ensure_ascii=False))
    else:
        print("tokenizer_config.json: none")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                   "tests", "data", "hf_tokenizer"))
    ap.add_argument("--quiet", action="store_true", help="do not print the tokenizer.json structure")
    args = ap.parse_args()
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}; {len(TEXTS)} texts")

    for name in NAMES:
        d = os.path.join(args.data, name)
        path, cfg_path = os.path.join(d, "tokenizer.json"), os.path.join(d, "tokenizer_config.json")
        if not args.quiet:
            describe(name, path, cfg_path)
        settings = settings_from_config(cfg_path)
        tok = PreTrainedTokenizerFast(tokenizer_file=path, **settings)
        raw = tokenizers.Tokenizer.from_file(path)
        print(f"{name}: PreTrainedTokenizerFast settings {json.dumps(settings, ensure_ascii=False)}; "
              f"bos={tok.bos_token!r} ({tok.bos_token_id}) eos={tok.eos_token!r} ({tok.eos_token_id}); "
              f"post_processor in use: {tok.backend_tokenizer.post_processor}")
        out = os.path.join(d, "golden.jsonl")
        n_ids = 0
        with open(out, "w", encoding="utf-8", newline="\n") as f:
            for text in TEXTS:
                ids = tok.encode(text, add_special_tokens=False)
                ids_sp = tok.encode(text, add_special_tokens=True)
                check = raw.encode(text, add_special_tokens=False).ids
                if ids != check:
                    sys.exit(f"{name}: transformers and tokenizers disagree on {text!r}:\n  {ids}\n  {check}")
                n_ids += len(ids)
                f.write(json.dumps({"text": text, "ids": ids, "ids_with_special": ids_sp},
                                   ensure_ascii=False) + "\n")
        extra = {len(tok.encode(t, add_special_tokens=True)) - len(tok.encode(t, add_special_tokens=False))
                 for t in TEXTS}
        print(f"{name}: wrote {out} ({len(TEXTS)} lines, {n_ids} ids; ids_with_special adds {sorted(extra)} ids)")


if __name__ == "__main__":
    main()
