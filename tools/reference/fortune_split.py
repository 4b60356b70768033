"""The train / validation / held-out split of Debian's fortunes text (package `fortunes`, pinned in
third_party/debian_packages.txt), used to train and evaluate the embedded default model.

The rule, stated so that other code (the engine's C++ perplexity test) cuts the same text:
  1. Files: the regular files directly in the fortunes folder (/usr/share/games/fortunes) whose
     names contain no '.' (this skips the *.dat indexes and the *.u8 links), in byte-wise name
     order.
  2. Entries: each file is read as bytes and decoded as UTF-8 (invalid bytes become U+FFFD), '\r'
     is dropped, and the text is split at lines that are exactly "%". An entry is the text between
     two such lines with trailing ASCII whitespace (space, \t, \n, \v, \f) removed (leading
     whitespace kept); entries that are
     empty after that are dropped and not counted.
  3. Entry i (0-based, counted over all files in order) is held out if i % 10 == 9, validation
     (used only to pick the checkpoint while training) if i % 10 == 8, training otherwise.
  4. The held-out token stream is, for each held-out entry in order, the tokenizer's ids of the
     entry (no special tokens added) followed by the id of <|endoftext|>.

Usage: python3 fortune_split.py [DIR]  prints the counts of each part.
"""
import os
import sys

DEFAULT_DIR = "/usr/share/games/fortunes"


def fortune_files(folder):
    names = sorted(n for n in os.listdir(folder)
                   if "." not in n and os.path.isfile(os.path.join(folder, n))
                   and not os.path.islink(os.path.join(folder, n)))
    if not names:
        raise FileNotFoundError(f"no fortune files in {folder} (apt-get install fortunes)")
    return [os.path.join(folder, n) for n in sorted(names, key=lambda s: s.encode())]


def entries(folder=DEFAULT_DIR):
    """All entries in file order (rules 1 and 2)."""
    out = []
    for path in fortune_files(folder):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace").replace("\r", "")
        cur = []
        for line in text.split("\n") + ["%"]:
            if line == "%":
                entry = "\n".join(cur).rstrip(" \t\n\v\f")
                if entry:
                    out.append(entry)
                cur = []
            else:
                cur.append(line)
    return out


def split(folder=DEFAULT_DIR):
    """(train, validation, held_out) lists of entries (rule 3)."""
    train, val, held = [], [], []
    for i, e in enumerate(entries(folder)):
        (held if i % 10 == 9 else val if i % 10 == 8 else train).append(e)
    return train, val, held


if __name__ == "__main__":
    tr, va, he = split(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR)
    print(f"train {len(tr)} entries, {sum(map(len, tr))} chars; validation {len(va)}, "
          f"{sum(map(len, va))} chars; held out {len(he)}, {sum(map(len, he))} chars")
