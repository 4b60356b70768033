#!/usr/bin/python3
"""Writes the small synthetic tokenizer.json files that exercise options Qwen3's file does not use.

  /usr/bin/python3 engine/tokenizer/testdata/make_synthetic_tokenizers.py engine/tokenizer/testdata

Then make_tokenizer_fixture.mjs encodes seeded strings with each through Hugging Face tokenizers.

synthetic_bytefallback.json: merges as ["a", "b"] pairs (one with a space inside a token),
  byte_fallback with <0xXX> tokens, unk_token with fuse_unk, NFKC, a Split pre-tokenizer on a
  String with MergedWithPrevious, added tokens with lstrip / rstrip / single_word / normalized,
  a TemplateProcessing post-processor, decoders ByteFallback + Fuse + Replace + Strip.
synthetic_ignore_merges.json: byte-level with use_regex and add_prefix_space, ignore_merges (whole
  words in the vocabulary win over merges), merges as "a b" strings, a Split regex with
  Contiguous behavior, NFD, an added token outside the byte-level alphabet.
synthetic_split_behaviors.json: Lowercase + Prepend normalizers, Split with Removed,
  MergedWithPrevious and an inverted MergedWithNext, continuing_subword_prefix "##", unk_token
  without fuse_unk, RobertaProcessing, and no decoder (tokens joined by spaces).
"""
import json
import os
import sys


def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def add_merges(vocab, merges, pairs):
    for a, b in pairs:
        for t in (a, b):
            assert t in vocab, t
        vocab.setdefault(a + b, len(vocab))
        merges.append([a, b])


def bytefallback():
    vocab = {"<unk>": 0}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for c in "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-é中文":
        vocab.setdefault(c, len(vocab))
    merges = []
    add_merges(vocab, merges, [("t", "h"), ("th", "e"), (" ", "the"), ("i", "n"), ("in", "g"),
                               ("e", "r"), ("a", "n"), ("an", "d"), (" ", "and"), ("o", "n"),
                               ("e", "s"), ("t", "o"), (" ", "t"), (" t", "o"), ("l", "l"),
                               ("e", "ll"), ("h", "ell"), ("hell", "o"), ("中", "文"), ("a", "a"),
                               ("aa", "aa"), ("aa", "a")])
    added = [
        {"id": len(vocab), "content": "<s>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True},
        {"id": len(vocab) + 1, "content": "[MASK]", "single_word": False, "lstrip": True,
         "rstrip": True, "normalized": False, "special": True},
        {"id": len(vocab) + 2, "content": "word", "single_word": True, "lstrip": False,
         "rstrip": False, "normalized": True, "special": False},
        {"id": len(vocab) + 3, "content": "ﬁne", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": True, "special": False},
    ]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFKC"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                          "behavior": "MergedWithNext", "invert": False},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [len(vocab)],
                                                      "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def ignore_merges():
    b2u = bytes_to_unicode()
    vocab = {}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    sp = b2u[ord(" ")]
    merges = []
    add_merges(vocab, merges, [("t", "h"), ("th", "e"), (sp, "the"), ("e", "r"), (sp, "t"),
                               ("i", "n"), ("in", "g"), ("o", "n"), ("e", "s"), ("a", "n"),
                               ("an", "d"), (sp, "and"), ("w", "o"), ("wo", "r"), ("d", "s")])
    # Whole words reachable only through ignore_merges: their merges would split them otherwise.
    for w in [sp + "words", "words", sp + "tokenizer", "ing", sp + "running", "3.14"]:
        vocab.setdefault(w, len(vocab))
    added = [{"id": len(vocab), "content": "<|end|>", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True},
             {"id": len(vocab) + 1, "content": "→ok", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": False}]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFD"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}+"}, "behavior": "Contiguous",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
             "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": True, "vocab": vocab,
                  "merges": [a + " " + b for a, b in merges]},
    }


def split_behaviors():
    vocab = {"<s>": 0, "[UNK]": 1, "</s>": 2}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'_":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault("##" + c, len(vocab))
    vocab.setdefault("▁", len(vocab))
    merges = []
    for a, b in [("t", "##h"), ("th", "##e"), ("##i", "##n"), ("##in", "##g"), ("a", "##n"),
                 ("an", "##d"), ("##e", "##r"), ("▁", "##t"), ("o", "##f"), ("##o", "##n")]:
        merged = a + b[2:] if b.startswith("##") else a + b
        vocab.setdefault(merged, len(vocab))
        merges.append([a, b])
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t, i in [("<s>", 0), ("[UNK]", 1),
                                                                 ("</s>", 2)]]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Lowercase"}, {"type": "Prepend", "prepend": "▁"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed",
             "invert": False},
            {"type": "Split", "pattern": {"Regex": "[.,!?;:]"},
             "behavior": "MergedWithPrevious", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[a-z]+"}, "behavior": "MergedWithNext",
             "invert": True}]},
        "post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0],
                           "trim_offsets": True, "add_prefix_space": False},
        "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "[UNK]",
                  "continuing_subword_prefix": "##", "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def main():
    out = sys.argv[1]
    for name, t in [("synthetic_bytefallback.json", bytefallback()),
                    ("synthetic_ignore_merges.json", ignore_merges()),
                    ("synthetic_split_behaviors.json", split_behaviors())]:
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(t, f, ensure_ascii=False)
            f.write("\n")


if __name__ == "__main__":
    main()
