#!/usr/bin/env python3
"""Trains the embedded default model, models/tiny_qwen3_moe: a byte-level BPE tokenizer (HF
tokenizers, Qwen2's pre-tokenizer) and a small qwen3_moe (HF transformers) on Debian's fortunes,
then evaluates it with transformers on the CPU and writes REFERENCE.json.

Run on a CUDA machine with torch, transformers and tokenizers (see tools/reference/README.md):
  python3 tools/reference/train_tiny.py --backend hf --fortunes /usr/share/games/fortunes \
      --out models/tiny_qwen3_moe --train-seconds 240
or on a CPU with Debian's torch and tokenizers' Node binding (--backend torch: qwen_torch.py for
the model, train_tokenizer.mjs for the tokenizer; the README has the exact command).

Output folder: config.json, generation_config.json, model.safetensors (bf16, the Hub's per-expert
layout), tokenizer.json, tokenizer_config.json (ChatML template), REFERENCE.json.
The split of the text is fortune_split.py's rule; the evaluation is stated in REFERENCE.json.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fortune_split  # noqa: E402
import hfio  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special (as in Qwen3)
# Qwen2/Qwen3's pre-tokenizer split (tokenizer.json "Split" Regex).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_USER = "Tell me a fortune."
CHAT_PREFIX = "<|im_start|>user\n" + CHAT_USER + "<|im_end|>\n<|im_start|>assistant\n"
# A Qwen2.5-style ChatML template (system turn optional, tool calls in <tool_call> tags).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
GREEDY_PROMPTS = ["Once upon a time", "The meaning of life is", "Q: Why did the chicken cross the road?\nA:"]
EVAL_WINDOW = 256


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_tokenizer(texts, vocab_size):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
        processors, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = len(SPECIAL) + len(ADDED)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    # Special tokens after the learned vocabulary, as in Qwen's tokenizers.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def tokenizer_config():
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(args, vocab, eot, im_end):
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "moe_intermediate_size": args.moe_inter,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.layers,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.01,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "torch_dtype": "bfloat16",
    }


def encode_stream(tok, docs):
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int64)


def hub_state_dict(model, config):
    """The model's weights as float32 numpy arrays named in the Hub's per-expert layout, whatever
    layout this transformers version keeps in memory (fused gate_up_proj in transformers 5)."""
    E, I, H = config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]
    out = {}
    params = {n for n, _ in model.named_parameters()}  # a tied lm_head is listed once, as the embedding
    for name, t in model.state_dict().items():
        if name not in params or (name == "lm_head.weight" and config["tie_word_embeddings"]):
            continue
        x = t.detach().float().cpu().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[:-len("gate_up_proj")]
            if x.shape == (E, 2 * I, H):
                g, u = x[:, :I, :], x[:, I:, :]
            elif x.shape == (E, H, 2 * I):
                g, u = x[:, :, :I].transpose(0, 2, 1), x[:, :, I:].transpose(0, 2, 1)
            else:
                raise RuntimeError(f"{name}: unexpected shape {x.shape}")
            for e in range(E):
                out[f"{p}{e}.gate_proj.weight"] = np.ascontiguousarray(g[e])
                out[f"{p}{e}.up_proj.weight"] = np.ascontiguousarray(u[e])
        elif name.endswith("mlp.experts.down_proj"):
            p = name[:-len("down_proj")]
            if x.shape == (E, H, I):
                d = x
            elif x.shape == (E, I, H):
                d = x.transpose(0, 2, 1)
            else:
                raise RuntimeError(f"{name}: unexpected shape {x.shape}")
            for e in range(E):
                out[f"{p}{e}.down_proj.weight"] = np.ascontiguousarray(d[e])
        else:
            out[name] = x
    return out


def build_model(config_dir, device, impl):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(config_dir)
    config.output_router_logits = True  # adds the load-balancing loss while training
    kwargs = dict(attn_implementation="sdpa")
    if impl is not None:
        kwargs["experts_implementation"] = impl
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.to(device)


def train(args, model, train_ids, val_ids, device):
    rng = np.random.default_rng(0)
    T, B = args.seq, args.batch
    cuda = device == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    train_t = torch.from_numpy(train_ids).to(device)
    n_val = min(len(val_ids) // T, 64)
    val_batch = torch.from_numpy(val_ids[:n_val * T].reshape(n_val, T)).to(device)

    def batch():
        offs = rng.integers(0, len(train_ids) - T - 1, B)
        idx = torch.from_numpy(offs).to(device)[:, None] + torch.arange(T, device=device)[None, :]
        return train_t[idx]

    def val_loss():
        model.eval()
        total = 0.0
        with torch.no_grad(), autocast():
            for i in range(0, n_val, 16):
                x = val_batch[i:i + 16]
                logits = model(x).logits.float()
                total += torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                    reduction="sum").item()
        model.train()
        return total / (n_val * (T - 1))

    def step(lr):
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch()
        with autocast():
            out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return out.loss.item()

    model.train()
    warmup = 50
    # Calibrate the step time, then fix the number of steps so the cosine schedule ends on time.
    t0 = time.time()
    for i in range(10):
        step(args.lr * (i + 1) / warmup)
    if cuda:
        torch.cuda.synchronize()
    per_step = (time.time() - t0) / 10
    total = max(100, int(args.train_seconds / per_step))
    log(f"{per_step * 1000:.1f} ms/step (calibration, incl. warm-up): {total} steps "
        f"of {B}x{T} tokens in ~{args.train_seconds} s")
    best, best_state, history = float("inf"), None, []
    eval_every = max(50, total // 15)
    t_start = time.time()
    for i in range(10, total):
        if i < warmup:
            lr = args.lr * (i + 1) / warmup
        else:
            frac = (i - warmup) / max(1, total - warmup)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        loss = step(lr)
        if (i + 1) % eval_every == 0 or i == total - 1:
            v = val_loss()
            history.append(dict(step=i + 1, train_loss=round(loss, 4), val_loss=round(v, 4)))
            log(f"step {i + 1}/{total} lr {lr:.2e} train loss {loss:.3f} val loss {v:.3f} "
                f"(ppl {math.exp(v):.1f}) {time.time() - t_start:.0f} s")
            if v < best:
                best = v
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        if time.time() - t_start > args.train_seconds * 1.15:
            log(f"stopping at step {i + 1}: over the time budget")
            break
    model.load_state_dict(best_state)
    return dict(steps=i + 1, ms_per_step=round(per_step * 1000, 1), best_val_loss=round(best, 4),
                history=history, seconds=round(time.time() - t_start, 1))


def load_reference(folder):
    """transformers' model from the saved folder on the CPU in float32, eager attention and
    experts (the deterministic reference path)."""
    from transformers import AutoModelForCausalLM
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    try:
        return AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError) as e:
        log(f"experts_implementation=eager not accepted ({e}); default experts implementation")
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def greedy_ids(model, prompt, n, pad):
    """n greedy tokens, EOS ignored: generate's, checked against argmax steps of full forwards
    (no KV cache); where generate stopped early or disagrees, the full-forward tokens are kept."""
    from transformers import GenerationConfig
    x = torch.tensor([prompt])
    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=pad)
    with torch.no_grad():
        try:
            gen = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
            out = [int(t) for t in gen[0, len(prompt):]]
        except Exception as e:  # the reference must still be written
            log(f"WARNING: generate failed ({type(e).__name__}: {e})")
            out = []
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    manual = ids[len(prompt):]
    if out != manual:
        log(f"WARNING: generate gave {out}, full-forward argmax {manual}; keeping the latter")
    return manual


def heldout_perplexity(model, ids):
    """Mean NLL over the predicted tokens of all full, non-overlapping windows of EVAL_WINDOW
    tokens of the held-out stream, each window run from position 0 (no context carried over)."""
    n = len(ids) // EVAL_WINDOW
    windows = torch.from_numpy(ids[:n * EVAL_WINDOW].reshape(n, EVAL_WINDOW))
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 16):
            x = windows[i:i + 16]
            logits = model(x).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                reduction="sum").double().item()
    count = n * (EVAL_WINDOW - 1)
    return dict(windows=n, predicted_tokens=count, mean_nll=total / count, perplexity=math.exp(total / count))


# --- --backend torch: the same recipe without transformers or the tokenizers Python package ------

def node_tokenizers(*args):
    """Runs train_tokenizer.mjs (HF tokenizers' Node binding) with args."""
    import subprocess
    subprocess.run(["node", os.path.join(HERE, "train_tokenizer.mjs"), *args], check=True)


def torch_train(args, model, cfg, train_ids, val_ids):
    """train() for qwen_torch's model: float32 on the CPU, loss = mean next-token cross entropy +
    router_aux_loss_coef * load-balancing loss (what transformers adds with output_router_logits)."""
    import qwen_torch
    rng = np.random.default_rng(0)
    T, B = args.seq, args.batch
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    train_t = torch.from_numpy(train_ids)
    n_val = min(len(val_ids) // T, 32)
    val_batch = torch.from_numpy(val_ids[:n_val * T].reshape(n_val, T))
    coef = cfg["router_aux_loss_coef"]

    def ce(logits, x):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum")

    def val_loss():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(0, n_val, 8):
                x = val_batch[i:i + 8]
                total += ce(model(x)[0], x).item()
        model.train()
        return total / (n_val * (T - 1))

    def step(lr):
        for g in opt.param_groups:
            g["lr"] = lr
        offs = rng.integers(0, len(train_ids) - T - 1, B)
        x = train_t[torch.from_numpy(offs)[:, None] + torch.arange(T)[None, :]]
        logits, router_logits = model(x)
        loss = ce(logits, x) / (B * (T - 1))
        aux = qwen_torch.load_balancing_loss(router_logits, cfg["num_experts"], cfg["num_experts_per_tok"])
        opt.zero_grad(set_to_none=True)
        (loss + coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    model.train()
    # The CPU is shared with other work, so the step time drifts: the cosine schedule runs on the
    # wall clock (fraction of train_seconds elapsed) instead of a step count fixed in advance.
    warmup = 30
    best, best_state, history = float("inf"), None, []
    eval_every_s = args.train_seconds / 15
    t_start = time.time()
    next_eval = eval_every_s
    i = 0
    while True:
        frac = (time.time() - t_start) / args.train_seconds
        if i < warmup:
            lr = args.lr * (i + 1) / warmup
        else:
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        loss = step(lr)
        i += 1
        elapsed = time.time() - t_start
        done = elapsed >= args.train_seconds
        if elapsed >= next_eval or done:
            next_eval += eval_every_s
            v = val_loss()
            history.append(dict(step=i, train_loss=round(loss, 4), val_loss=round(v, 4)))
            log(f"step {i} lr {lr:.2e} train loss {loss:.3f} val loss {v:.3f} "
                f"(ppl {math.exp(v):.1f}) {elapsed:.0f} s")
            if v < best:
                best = v
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        if done:
            break
    per_step = (time.time() - t_start) / i
    model.load_state_dict(best_state)
    return dict(steps=i, ms_per_step=round(per_step * 1000, 1), best_val_loss=round(best, 4),
                history=history, seconds=round(time.time() - t_start, 1))


def torch_heldout_perplexity(model, ids):
    """heldout_perplexity() for qwen_torch's model (float64)."""
    n = len(ids) // EVAL_WINDOW
    windows = torch.from_numpy(ids[:n * EVAL_WINDOW].reshape(n, EVAL_WINDOW).astype(np.int64))
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 8):
            x = windows[i:i + 8]
            logits = model(x)[0]
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
    count = n * (EVAL_WINDOW - 1)
    return dict(windows=n, predicted_tokens=count, mean_nll=total / count, perplexity=math.exp(total / count))


def encode_job(tok_file, streams, decode=None):
    """Ids of each stream ({name: [text]}, concatenated, int64) and decoded id lists, through the
    Node binding."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        job = os.path.join(d, "job.json")
        with open(job, "w") as f:
            json.dump(dict(streams=streams, decode=decode or {}), f)
        node_tokenizers("encode", tok_file, job, d)
        ids = {k: np.load(os.path.join(d, f"{k}.npy")).astype(np.int64) for k in streams}
        with open(os.path.join(d, "decoded.json")) as f:
            return ids, json.load(f)


def torch_evaluate(args, out, held_ids, extra):
    """REFERENCE.json from the saved bf16 folder with qwen_torch in float64."""
    import qwen_torch
    tok_file = os.path.join(out, "tokenizer.json")
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    eot, im_end = cfg["bos_token_id"], cfg["eos_token_id"]
    ref = qwen_torch.load_model(out, torch.float64)
    n_params = sum(p.numel() for p in ref.parameters())
    t0 = time.time()
    ppl = torch_heldout_perplexity(ref, held_ids)
    log(f"held-out perplexity {ppl['perplexity']:.3f} (mean NLL {ppl['mean_nll']:.4f} over "
        f"{ppl['predicted_tokens']} tokens, {ppl['windows']} windows) in {time.time() - t0:.1f} s")

    import jinja2
    msgs = [{"role": "user", "content": CHAT_USER}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    chat_text = env.from_string(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True, tools=None)
    if chat_text != CHAT_PREFIX:
        log(f"WARNING: chat template renders {chat_text!r}, training used {CHAT_PREFIX!r}")
    prompt_ids, _ = encode_job(tok_file, {f"p{i}": [t] for i, t in enumerate(GREEDY_PROMPTS + [chat_text])})
    prompt_ids = [[int(t) for t in prompt_ids[f"p{i}"]] for i in range(len(GREEDY_PROMPTS) + 1)]
    outs = [qwen_torch.greedy(ref, p, 64) for p in prompt_ids[:-1]]
    # Chat: greedy until <|im_end|> or <|endoftext|> (included), at most 64 tokens.
    ids = list(prompt_ids[-1])
    with torch.no_grad():
        for _ in range(64):
            ids.append(int(ref(torch.tensor([ids]))[0][0, -1].argmax()))
            if ids[-1] in (im_end, eot):
                break
    chat_out = ids[len(prompt_ids[-1]):]
    _, decoded = encode_job(tok_file, {}, {"d": outs + [chat_out]})
    texts = decoded["d"]
    greedy = []
    for text, p, o, t in zip(GREEDY_PROMPTS, prompt_ids, outs, texts):
        greedy.append(dict(prompt=text, prompt_ids=p, output_ids=o, output_text=t))
        log(f"greedy {text!r} -> {t!r}")
    chat = dict(messages=msgs, add_generation_prompt=True, prompt_text=chat_text, prompt_ids=prompt_ids[-1],
                output_ids=chat_out, output_text=texts[-1],
                stop="generation stops at <|im_end|> or <|endoftext|> (included in output_ids)")
    log(f"chat -> {texts[-1]!r}")
    how_model = ("tools/reference/qwen_torch.py (transformers' qwen3_moe modeling code in PyTorch; "
                 "--backend hf reproduces it with transformers itself) on the CPU in float64 from the "
                 "bf16 weights")
    reference = {
        "model": "tiny_qwen3_moe",
        "backend": "torch",
        "parameters": n_params,
        "heldout": dict(
            text="Debian fortunes=1:1.99.1-7.3, /usr/share/games/fortunes, split by "
                 "tools/reference/fortune_split.py: entry i (0-based over all files in byte-wise name "
                 "order) is held out iff i % 10 == 9",
            stream="for each held-out entry: tokenizer ids of the entry (no special tokens) then "
                   "<|endoftext|>",
            stream_tokens=int(len(held_ids)), stream_first_ids=[int(t) for t in held_ids[:16]],
            stream_ids_sum=int(held_ids.sum()),
            how=f"all full non-overlapping windows of {EVAL_WINDOW} tokens from the stream's start, each "
                f"run from position 0; teacher-forced; {how_model}; mean NLL (natural log) over the "
                f"predicted tokens (the last {EVAL_WINDOW - 1} of each window); perplexity = exp(mean NLL)",
            **ppl),
        "greedy": dict(how=f"{how_model}, 64 new tokens, EOS ignored: the argmax of a full forward at "
                           "each step; prompts encoded without special tokens", cases=greedy),
        "chat": chat,
    }
    reference.update(extra)
    with open(os.path.join(out, "REFERENCE.json"), "w") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
        f.write("\n")
    log("REFERENCE.json written")


def main_torch(args):
    """The recipe of main() with qwen_torch and HF tokenizers' Node binding, on the CPU."""
    import qwen_torch
    torch.set_num_threads(args.threads)
    out = args.out
    os.makedirs(out, exist_ok=True)
    tok_file = os.path.join(out, "tokenizer.json")
    train_docs, val_docs, held_docs = fortune_split.split(args.fortunes)
    log(f"fortunes: {len(train_docs)} train, {len(val_docs)} validation, {len(held_docs)} held-out entries")
    docs = [(CHAT_PREFIX + d + "<|im_end|>\n") if args.chat_every and i % args.chat_every == 0
            else d + "<|endoftext|>" for i, d in enumerate(train_docs)]
    held_stream = [d + "<|endoftext|>" for d in held_docs]
    if args.eval_only:
        ids, _ = encode_job(tok_file, {"held": held_stream})
        old = {}
        if os.path.exists(os.path.join(out, "REFERENCE.json")):
            with open(os.path.join(out, "REFERENCE.json")) as f:
                old = json.load(f)
        torch_evaluate(args, out, ids["held"], {k: old[k] for k in ("train", "versions") if k in old})
        return
    import tempfile
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "train.txt")
        with open(text, "w") as f:
            f.write("\n".join(train_docs) + "\n")
        node_tokenizers("train", text, str(args.vocab), tok_file)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    # The training stream is encoded with special tokens matched (split_special_tokens off); the
    # held-out stream's entries then <|endoftext|>: the same ids as encoding each entry alone.
    ids, _ = encode_job(tok_file, {"train": docs, "val": [d + "<|endoftext|>" for d in val_docs],
                                   "held": held_stream})
    train_ids, val_ids, held_ids = ids["train"], ids["val"], ids["held"]
    with open(tok_file) as f:
        tj = json.load(f)
    vocab = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    special = {t["content"]: t["id"] for t in tj["added_tokens"]}
    eot, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    log(f"tokenizer: {vocab} tokens in {time.time() - t0:.1f} s; <|endoftext|> {eot}, <|im_end|> {im_end}; "
        f"tokens: train {len(train_ids)}, validation {len(val_ids)}, held-out {len(held_ids)}")

    cfg = model_config(args, vocab, eot, im_end)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot,
                   "do_sample": False}, f, indent=2)
        f.write("\n")
    torch.manual_seed(0)
    model = qwen_torch.MoeForCausalLM(cfg)
    model.init_weights(0)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 2 / 1e6:.2f} MB in bf16)")
    info = torch_train(args, model, cfg, train_ids, val_ids)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    hfio.write_checkpoint(out, {k: hfio.Tensor.bf16(hfio.bf16_round(v)) for k, v in weights.items()})
    log("checkpoint written")
    extra = {
        "train": dict(vars(args), optimizer="AdamW(0.9, 0.95), weight decay on matrices only, grad clip "
                      "1.0, float32 on the CPU", schedule="linear warm-up 30 steps, then cosine to 10% of the peak over the wall-clock budget",
                      data=("training entries, each followed by <|endoftext|>; every chat_every-th wrapped as "
                            f"{CHAT_PREFIX!r} + entry + '<|im_end|>\\n'; random windows of seq tokens"),
                      loss="mean next-token cross entropy + router_aux_loss_coef * load-balancing loss",
                      checkpoint="the evaluation with the lowest validation loss (entries i % 10 == 8)",
                      tokenizer=("tools/reference/train_tokenizer.mjs (HF tokenizers' Node binding "
                                 f"{node_tokenizers_version()})"),
                      train_tokens=int(len(train_ids)), **info),
        "versions": dict(torch=torch.__version__, device="cpu"),
    }
    for k in ("out", "fortunes", "eval_only"):
        extra["train"].pop(k, None)
    torch_evaluate(args, out, held_ids, extra)


def node_tokenizers_version():
    import subprocess
    r = subprocess.run(["node", "-e", "console.log(require('tokenizers/package.json').version)"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fortunes", default=fortune_split.DEFAULT_DIR)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-every", type=int, default=10,
                    help="every Nth training entry is wrapped as a ChatML exchange (0: none)")
    ap.add_argument("--backend", choices=["hf", "torch"], default=None,
                    help="hf: transformers and tokenizers (Python); torch: qwen_torch.py and tokenizers' "
                         "Node binding on the CPU (default when transformers is absent)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (--backend torch)")
    ap.add_argument("--eval-only", action="store_true",
                    help="--backend torch: recompute REFERENCE.json from the saved folder")
    args = ap.parse_args()
    if args.backend is None:
        import importlib.util
        args.backend = "hf" if importlib.util.find_spec("transformers") else "torch"
    if args.backend == "torch":
        main_torch(args)
        return

    import tokenizers
    import transformers
    from transformers import AutoTokenizer, GenerationConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        log("WARNING: no CUDA device; training on the CPU")
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers "
        f"{tokenizers.__version__}, device {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}")
    os.makedirs(args.out, exist_ok=True)

    train_docs, val_docs, held_docs = fortune_split.split(args.fortunes)
    log(f"fortunes: {len(train_docs)} train, {len(val_docs)} validation, {len(held_docs)} held-out entries")

    t0 = time.time()
    tok = train_tokenizer(train_docs, args.vocab)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    log(f"tokenizer: {tok.get_vocab_size()} tokens in {time.time() - t0:.1f} s; "
        f"<|endoftext|> {eot}, <|im_end|> {im_end}")

    docs = [(CHAT_PREFIX + d + "<|im_end|>\n") if args.chat_every and i % args.chat_every == 0
            else d + "<|endoftext|>" for i, d in enumerate(train_docs)]
    # Special tokens in the text are matched as added tokens by encode (split_special_tokens off).
    train_ids = encode_stream(tok, docs)
    val_ids = encode_stream(tok, [d + "<|endoftext|>" for d in val_docs])
    held_ids = np.concatenate([np.asarray(tok.encode(d, add_special_tokens=False).ids + [eot], dtype=np.int64)
                               for d in held_docs])
    log(f"tokens: train {len(train_ids)}, validation {len(val_ids)}, held-out {len(held_ids)} "
        f"({sum(map(len, train_docs)) / max(1, len(train_ids)):.2f} chars/token on train)")

    cfg = model_config(args, tok.get_vocab_size(), eot, im_end)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot,
                   "do_sample": False}, f, indent=2)
        f.write("\n")

    model, impl_used = None, None
    for impl in ([None, "eager"] if device == "cuda" else ["eager"]):
        try:
            model = build_model(args.out, device, impl)
            x = torch.from_numpy(train_ids[:2 * 64].reshape(2, 64)).to(device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                model(input_ids=x, labels=x).loss.backward()
            model.zero_grad(set_to_none=True)
            impl_used = impl or getattr(model.config, "_experts_implementation", "default")
            break
        except Exception as e:  # e.g. a fused experts kernel this build lacks: fall back to eager
            log(f"experts implementation {impl}: {type(e).__name__}: {e}")
            model = None
    if model is None:
        sys.exit("could not build a trainable model")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 2 / 1e6:.2f} MB in bf16), experts implementation {impl_used}")

    info = train(args, model, train_ids, val_ids, device)

    # Save in bf16, Hub layout, then reload with transformers to check every tensor is read.
    weights = hub_state_dict(model, cfg)
    hfio.write_checkpoint(args.out, {k: hfio.Tensor.bf16(hfio.bf16_round(v)) for k, v in weights.items()})
    torch.set_num_threads(16)
    torch.use_deterministic_algorithms(True)
    ref, load_info = load_reference(args.out)
    bad = {k: [x for x in v if "lm_head" not in str(x)] for k, v in load_info.items()
           if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}  # lm_head is tied
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        sys.exit(f"transformers did not load every saved tensor: {bad}")
    ref.eval()
    # What transformers read back must be the trained weights rounded to bf16, tensor for tensor.
    got = ref.state_dict()
    for name, t in model.state_dict().items():
        if name in got and not torch.equal(got[name].float(), t.detach().cpu().bfloat16().float()):
            sys.exit(f"reloaded tensor {name} differs from the trained one")
    log("reloaded checkpoint matches the trained weights (bf16) exactly")
    del model

    t0 = time.time()
    ppl = heldout_perplexity(ref, held_ids)
    log(f"held-out perplexity {ppl['perplexity']:.3f} (mean NLL {ppl['mean_nll']:.4f} over "
        f"{ppl['predicted_tokens']} tokens, {ppl['windows']} windows) in {time.time() - t0:.1f} s")

    greedy = []
    with torch.no_grad():
        for text in GREEDY_PROMPTS:
            ids = tok.encode(text, add_special_tokens=False).ids
            out = greedy_ids(ref, ids, 64, eot)
            greedy.append(dict(prompt=text, prompt_ids=ids, output_ids=out,
                               output_text=tok.decode(out, skip_special_tokens=False)))
            log(f"greedy {text!r} -> {greedy[-1]['output_text']!r}")

    chat = None
    try:
        hf_tok = AutoTokenizer.from_pretrained(args.out)
        msgs = [{"role": "user", "content": CHAT_USER}]
        text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        if text != CHAT_PREFIX:
            log(f"WARNING: chat template renders {text!r}, training used {CHAT_PREFIX!r}")
        for g in greedy:
            if hf_tok(g["prompt"], add_special_tokens=False)["input_ids"] != g["prompt_ids"]:
                log(f"WARNING: AutoTokenizer and tokenizers disagree on {g['prompt']!r}")
        with torch.no_grad():
            x = torch.tensor([ids])
            gc = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=[im_end, eot], pad_token_id=eot)
            gen = ref.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
        out = [int(t) for t in gen[0, len(ids):]]
        chat = dict(messages=msgs, add_generation_prompt=True, prompt_text=text, prompt_ids=ids,
                    output_ids=out, output_text=hf_tok.decode(out, skip_special_tokens=False),
                    stop="generation stops at <|im_end|> or <|endoftext|> (included in output_ids)")
        log(f"chat -> {chat['output_text']!r}")
    except Exception as e:  # the reference must still be written
        log(f"chat check failed: {type(e).__name__}: {e}")

    reference = {
        "model": "tiny_qwen3_moe",
        "parameters": n_params,
        "heldout": dict(
            text="Debian fortunes=1:1.99.1-7.3, /usr/share/games/fortunes, split by "
                 "tools/reference/fortune_split.py: entry i (0-based over all files in byte-wise name "
                 "order) is held out iff i % 10 == 9",
            stream="for each held-out entry: tokenizer ids of the entry (no special tokens) then "
                   "<|endoftext|>",
            stream_tokens=int(len(held_ids)), stream_first_ids=[int(t) for t in held_ids[:16]],
            stream_ids_sum=int(held_ids.sum()),
            how=f"all full non-overlapping windows of {EVAL_WINDOW} tokens from the stream's start, each "
                "run from position 0; teacher-forced; transformers on the CPU in float32 from the bf16 "
                "weights, eager attention; mean NLL (natural log) over the predicted tokens (the last "
                f"{EVAL_WINDOW - 1} of each window); perplexity = exp(mean NLL)",
            **ppl),
        "greedy": dict(how="transformers on the CPU in float32 from the bf16 weights, 64 new tokens, EOS "
                           "ignored: generate(do_sample=False), checked against the argmax of a full "
                           "forward at each step; prompts encoded without special tokens",
                       cases=greedy),
        "chat": chat,
        "train": dict(vars(args), experts_implementation=str(impl_used), optimizer="AdamW(0.9, 0.95), "
                      "weight decay on matrices only, grad clip 1.0, bf16 autocast, float32 master weights",
                      schedule="linear warm-up 50 steps, cosine to 10% of the peak", data=(
                          "training entries, each followed by <|endoftext|>; every chat_every-th wrapped as "
                          f"{CHAT_PREFIX!r} + entry + '<|im_end|>\\n'; random windows of seq tokens"),
                      checkpoint="the step with the lowest validation loss (entries i % 10 == 8)",
                      train_tokens=int(len(train_ids)), **info),
        "versions": dict(torch=torch.__version__, transformers=transformers.__version__,
                         tokenizers=tokenizers.__version__,
                         device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu"),
    }
    reference["train"].pop("out", None)
    reference["train"].pop("fortunes", None)
    with open(os.path.join(args.out, "REFERENCE.json"), "w") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
        f.write("\n")
    log("done")


if __name__ == "__main__":
    main()
