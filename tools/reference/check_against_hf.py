#!/usr/bin/env python3
"""Checks the committed references against Hugging Face transformers and tokenizers themselves.

The committed fixtures (engine/testdata) and the default model's REFERENCE.json are computed with
--backend torch (qwen_torch.py in float64, tokenizers' Node binding). This script recomputes what
they hold with transformers (float32, eager attention and experts, on the CPU) and the tokenizers
Python package, from the committed files, and reports the differences:

- fixtures: transformers loads each committed folder (the fp8 case: its dequantized float32
  weights, rebuilt from make_fixtures.py's seeds; a qwen3_5_moe case: its text model as
  Qwen3_5MoeForCausalLM, from the committed tensors renamed out of the multimodal wrapper) with no
  missing or unexpected tensor; per prompt the max |logit difference| over the max |logit|
  against logits_<i>.npy; the greedy outputs of reference.json's prompts. For a qwen3_5_moe case
  it also reports (without failing on it) whether AutoModelForCausalLM loads the committed
  wrapper folder itself and gives the same logits;
- the default model: the prompts' ids, the 64-token greedy continuations, the chat turn (prompt
  rendered by transformers' apply_chat_template), the held-out stream (its length, first ids and
  id sum) and its perplexity.

Usage (the GPU machine's python3; see tools/reference/README.md):
  python3 tools/reference/check_against_hf.py --fixtures engine/testdata \
      --model models/tiny_qwen3_moe --fortunes /path/to/fortunes --json out.json
Exits 1 when a check fails (a logit difference over --tol, a different id anywhere, a perplexity
off by more than --ppl-tol relative).
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fortune_split  # noqa: E402
import make_fixtures  # noqa: E402
import qwen_torch  # noqa: E402
import train_tiny  # noqa: E402


def log(msg):
    print(msg, flush=True)


def load(folder, tied):
    model, info = train_tiny.load_reference(folder)
    bad = {k: [x for x in v if not (tied and "lm_head" in str(x))] for k, v in info.items()
           if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        raise RuntimeError(f"{folder}: transformers did not load every tensor: {bad}")
    return model.eval()


def check_fixture(case, root, tol):
    folder = os.path.join(root, case["name"])
    with open(os.path.join(folder, "reference.json")) as f:
        ref = json.load(f)
    result = dict(case=case["name"], ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = folder
        if case["dtype"] == "fp8_block":
            # transformers' fp8 path needs a GPU; the reference is the dequantized weights.
            config = make_fixtures.make_config(case)
            _, ref_weights = make_fixtures.to_tensors(case, make_fixtures.make_weights(case))
            make_fixtures.write_float32_reference_folder(case, config, ref_weights, tmp)
            src = tmp
        elif case["model_type"] == "qwen3_5_moe":
            # The text model alone, from the committed tensors (bf16 values read exactly).
            with open(os.path.join(folder, "config.json")) as f:
                config = json.load(f)
            make_fixtures.write_float32_reference_folder(case, config, qwen_torch.read_checkpoint(folder), tmp)
            src = tmp
        model = load(src, case["tied"])
        diffs = []
        with torch.no_grad():
            for i, p in enumerate(ref["prompts"]):
                got = model(torch.tensor([p], dtype=torch.long)).logits[0].float().numpy()
                want = np.load(os.path.join(folder, f"logits_{i}.npy"))
                d = float(np.abs(got - want).max() / np.abs(want).max())
                diffs.append(d)
                if got.shape != want.shape or not d <= tol:
                    result["ok"] = False
        result["logits_max_rel_diff"] = diffs
        if case["model_type"] == "qwen3_5_moe":
            result["wrapper_direct"] = try_wrapper_folder(folder, ref["prompts"], tol)
        greedy = []
        for g in ref["greedy"]:
            out = train_tiny.greedy_ids(model, g["prompt"], len(g["output"]), 0)
            same = out == g["output"]
            greedy.append(dict(prompt_len=len(g["prompt"]), same=same, **({} if same else dict(hf=out))))
            result["ok"] &= same
        result["greedy"] = greedy
    log(f"  {case['name']}: logits max rel diff {max(diffs):.3g}, greedy "
        f"{sum(g['same'] for g in greedy)}/{len(greedy)} identical -> {'ok' if result['ok'] else 'FAIL'}")
    return result


def try_wrapper_folder(folder, prompts, tol):
    """Whether transformers loads a committed qwen3_5_moe folder (the multimodal wrapper) as a
    causal LM with every text tensor used, and its logits against logits_<i>.npy. Informational:
    the check itself runs on the text model."""
    try:
        model, info = train_tiny.load_reference(folder)
        missing = [k for k in info.get("missing_keys", [])]
        diffs = []
        with torch.no_grad():
            for i, p in enumerate(prompts):
                got = model(torch.tensor([p], dtype=torch.long)).logits[0].float().numpy()
                want = np.load(os.path.join(folder, f"logits_{i}.npy"))
                diffs.append(float(np.abs(got - want).max() / np.abs(want).max()))
        out = dict(loaded=True, cls=type(model).__name__, missing_keys=missing[:10],
                   unexpected_keys=list(info.get("unexpected_keys", []))[:10], logits_max_rel_diff=diffs,
                   same=not missing and all(d <= tol for d in diffs))
    except Exception as e:  # informational only
        out = dict(loaded=False, error=f"{type(e).__name__}: {e}")
    log(f"    wrapper folder loaded directly: {out}")
    return out


def check_model(folder, fortunes, ppl_tol):
    import tokenizers
    from transformers import AutoTokenizer
    with open(os.path.join(folder, "REFERENCE.json")) as f:
        ref = json.load(f)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    eot, im_end = cfg["bos_token_id"], cfg["eos_token_id"]
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    model = load(folder, cfg.get("tie_word_embeddings", False))
    res = dict(ok=True)

    greedy = []
    for g in ref["greedy"]["cases"]:
        ids = tok.encode(g["prompt"], add_special_tokens=False).ids
        out = train_tiny.greedy_ids(model, ids, len(g["output_ids"]), eot)
        e = dict(prompt=g["prompt"], prompt_ids_same=ids == g["prompt_ids"], output_same=out == g["output_ids"],
                 text_same=tok.decode(out, skip_special_tokens=False) == g["output_text"])
        if not e["output_same"]:
            e["hf_output_ids"] = out
        greedy.append(e)
        res["ok"] &= e["prompt_ids_same"] and e["output_same"] and e["text_same"]
        log(f"  greedy {g['prompt']!r}: prompt ids {e['prompt_ids_same']}, output {e['output_same']}, "
            f"text {e['text_same']}")
    res["greedy"] = greedy

    c = ref["chat"]
    hf_tok = AutoTokenizer.from_pretrained(folder)
    text = hf_tok.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"],
                                      tokenize=False)
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(64):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            if seq[-1] in (im_end, eot):
                break
    out = seq[len(ids):]
    res["chat"] = dict(prompt_text_same=text == c["prompt_text"], prompt_ids_same=ids == c["prompt_ids"],
                       output_same=out == c["output_ids"])
    res["ok"] &= all(res["chat"].values())
    log(f"  chat: {res['chat']}")

    if fortunes:
        _, _, held_docs = fortune_split.split(fortunes)
        held = np.concatenate([np.asarray(tok.encode(d, add_special_tokens=False).ids + [eot], dtype=np.int64)
                               for d in held_docs])
        h = ref["heldout"]
        stream_same = (len(held) == h["stream_tokens"] and [int(t) for t in held[:16]] == h["stream_first_ids"]
                       and int(held.sum()) == h["stream_ids_sum"])
        torch.set_num_threads(16)
        ppl = train_tiny.heldout_perplexity(model, held)
        rel = abs(ppl["perplexity"] - h["perplexity"]) / h["perplexity"]
        res["heldout"] = dict(stream_same=stream_same, perplexity_hf=ppl["perplexity"],
                              perplexity_reference=h["perplexity"], rel_diff=rel, windows=ppl["windows"])
        res["ok"] &= stream_same and rel <= ppl_tol
        log(f"  held-out: stream {stream_same}, perplexity transformers {ppl['perplexity']:.6f} vs "
            f"reference {h['perplexity']:.6f} (rel {rel:.2g})")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", help="engine/testdata")
    ap.add_argument("--model", help="models/tiny_qwen3_moe")
    ap.add_argument("--fortunes", help="Debian fortunes' folder (held-out perplexity); skipped if absent")
    ap.add_argument("--tol", type=float, default=1e-4, help="max |logit diff| / max |logit| per prompt")
    ap.add_argument("--ppl-tol", type=float, default=1e-4, help="relative perplexity difference")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import tokenizers
    import transformers
    torch.manual_seed(0)
    torch.set_num_threads(16)
    torch.use_deterministic_algorithms(True)
    out = dict(versions=dict(transformers=transformers.__version__, tokenizers=tokenizers.__version__,
                             torch=torch.__version__), ok=True)
    log(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, torch {torch.__version__}")
    if args.fixtures:
        log("fixtures:")
        out["fixtures"] = []
        for case in make_fixtures.CASES:
            try:
                r = check_fixture(case, args.fixtures, args.tol)
            except Exception as e:  # one broken case must not hide the others
                import traceback
                traceback.print_exc()
                r = dict(case=case["name"], ok=False, error=f"{type(e).__name__}: {e}")
            out["fixtures"].append(r)
            out["ok"] &= r["ok"]
    if args.model:
        log("default model:")
        try:
            out["model"] = check_model(args.model, args.fortunes, args.ppl_tol)
        except Exception as e:
            import traceback
            traceback.print_exc()
            out["model"] = dict(ok=False, error=f"{type(e).__name__}: {e}")
        out["ok"] &= out["model"]["ok"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    log("ALL OK" if out["ok"] else "SOME CHECKS FAILED")
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
