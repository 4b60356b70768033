#!/usr/bin/env python3
"""Compares the engine's teacher-forced logits with Hugging Face transformers on the same ids.

  1. ids:    python3 compare_logits.py make-ids --vocab 151936 --batch 2 --tokens 32 ids.npy
  2. engine: bazel-bin/tools/generate --model DIR --input_ids ids.npy --dump_logits engine.npy --dense_f32
  3. check:  python3 compare_logits.py compare --model DIR --input-ids ids.npy --logits engine.npy
             (runs transformers on DIR; or --reference ref.npy to compare two .npy files)

ids.npy: int32/int64 [batch, tokens]; logits .npy: float32 [batch, tokens, vocab] (or [tokens,
vocab] for one row). Per row it prints max |engine - reference| / max |reference| and how often the
argmax agrees, and exits 1 when a row's ratio exceeds --tol (default 1e-4: float32 weights and
--dense_f32; use about 2e-2 for bf16 dense weights or experts, more for fp8/fp4 experts).
transformers runs in float32 with eager attention on --device (cpu by default; a 30B checkpoint
needs about 4 bytes per parameter of memory there). numpy is the only other requirement.
--backend torch (the default where transformers is not installed) runs qwen_torch.py, a PyTorch
implementation of transformers' qwen3_moe / qwen2_moe / qwen3_5_moe modeling code, in float64 (8
bytes per parameter; FP8 checkpoints are not read there), instead of transformers.
"""
import argparse
import sys

import numpy as np


def make_ids(args):
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, args.vocab, (args.batch, args.tokens)).astype(np.int32)
    np.save(args.out, ids)
    print(f"wrote {args.out}: {ids.shape} ids below {args.vocab}")


def hf_logits(model_dir, ids, device):
    import torch
    from transformers import AutoModelForCausalLM
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.to(device).eval()
    out = []
    with torch.no_grad():
        for row in ids:  # one row per forward: no padding, no attention mask subtleties
            x = torch.as_tensor(row[None, :].astype(np.int64), device=device)
            out.append(model(x).logits[0].float().cpu().numpy())
    return np.stack(out)


def torch_logits(model_dir, ids):
    import os
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import qwen_torch
    model = qwen_torch.load_model(model_dir, torch.float64)
    with torch.no_grad():
        return np.stack([model(torch.as_tensor(row[None, :].astype(np.int64)))[0][0].float().numpy()
                         for row in ids])


def compare(args):
    ids = np.load(args.input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        sys.exit(f"{args.input_ids}: want integer ids [batch, tokens], got {ids.dtype} {ids.shape}")
    got = np.load(args.logits).astype(np.float32)
    if got.ndim == 2:
        got = got[None]
    if args.reference:
        want = np.load(args.reference).astype(np.float32)
        if want.ndim == 2:
            want = want[None]
    elif args.model and args.backend == "torch":
        want = torch_logits(args.model, ids)
    elif args.model:
        want = hf_logits(args.model, ids, args.device)
    else:
        sys.exit("give --model (run transformers) or --reference (a .npy of logits)")
    if got.shape != want.shape or got.shape[:2] != ids.shape:
        sys.exit(f"shapes differ: ids {ids.shape}, logits {got.shape}, reference {want.shape}")
    worst = 0.0
    for b in range(ids.shape[0]):
        diff = float(np.max(np.abs(got[b] - want[b])))
        scale = float(np.max(np.abs(want[b])))
        ratio = diff / max(scale, 1e-30)
        agree = float(np.mean(got[b].argmax(-1) == want[b].argmax(-1)))
        worst = max(worst, ratio if np.isfinite(ratio) else np.inf)
        print(f"row {b}: max abs diff {diff:.4g}, max |logit| {scale:.4g}, ratio {ratio:.3g}, "
              f"argmax agrees on {agree:.1%} of {ids.shape[1]} positions")
    ok = worst <= args.tol
    print(f"{'PASS' if ok else 'FAIL'}: worst ratio {worst:.3g} (tolerance {args.tol:g})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-ids", help="write random ids [batch, tokens] as int32 .npy")
    m.add_argument("out")
    m.add_argument("--vocab", type=int, required=True)
    m.add_argument("--batch", type=int, default=2)
    m.add_argument("--tokens", type=int, default=32)
    m.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare", help="compare engine logits with transformers or a .npy")
    c.add_argument("--input-ids", required=True)
    c.add_argument("--logits", required=True, help="the engine's --dump_logits output")
    c.add_argument("--model", help="HF model folder to run with transformers")
    c.add_argument("--reference", help="reference logits .npy instead of running transformers")
    c.add_argument("--device", default="cpu")
    c.add_argument("--backend", choices=["hf", "torch"], default=None,
                   help="with --model: hf runs transformers, torch runs qwen_torch.py in float64 "
                        "(default when transformers is absent)")
    c.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    if args.cmd == "make-ids":
        make_ids(args)
        return 0
    if args.backend is None:
        import importlib.util
        args.backend = "hf" if importlib.util.find_spec("transformers") else "torch"
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
