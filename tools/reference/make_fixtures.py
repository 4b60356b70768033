#!/usr/bin/env python3
"""Builds the engine's Hugging Face reference fixtures (engine/testdata/<case>/).

Each case is a small random qwen3_moe, qwen2_moe or qwen3_5_moe checkpoint in the published Qwen
layout (per-expert tensors as on the Hub; qwen3_5_moe as its multimodal wrapper with fused
experts), plus what transformers computes from it on the CPU in float32 with eager attention:
teacher-forced logits of 3-4 prompts and greedy continuations of 2.
The engine's hf_fixture_test loads the same folders and must reproduce those numbers.

Weights come from numpy with a fixed seed per case and are rounded to bfloat16-exact values, so
a float32 checkpoint loses nothing when the engine stores experts in bf16. The FP8 case stores
expert and attention projections as float8_e4m3fn with a float32 (bf16-exact) weight_scale_inv per
128x128 block; its reference is transformers running the DEQUANTIZED weights (fp8 * scale_inv) in
float32, while the engine computes with the fp8 weights and bf16/f32 activations.

With --backend torch (the default where transformers is not installed) the same numbers come
from qwen_torch.py, a PyTorch implementation of transformers' modeling code, run in float64.

Usage (see tools/reference/README.md):
  python3 tools/reference/make_fixtures.py --out engine/testdata --backend hf     # transformers
  /usr/bin/python3 tools/reference/make_fixtures.py --out engine/testdata --backend torch
  python3 tools/reference/make_fixtures.py --out /tmp/fx --no-hf           # files only, no logits
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hfio  # noqa: E402

# The cases. Sizes follow the engine's constraints (hidden and intermediate sizes multiples of 32,
# FP8 expert shapes multiples of 128) and keep all fixtures together under 3 MB.
CASES = [
    dict(name="qwen3_gqa_f32", seed=11, model_type="qwen3_moe", dtype="float32",
         vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
         moe_inter=32, inter=96, norm_topk=True, tied=False, prompt_lens=[1, 9, 23, 40],
         router_margin=0.02,
         notes="qwen3_moe, GQA 4:2, 8 experts top-2, norm_topk_prob, untied lm_head."),
    dict(name="qwen3_yarn_top3_sharded_f32", seed=22, model_type="qwen3_moe", dtype="float32",
         vocab=256, hidden=32, layers=2, heads=4, kv_heads=1, head_dim=32, experts=6, top_k=3,
         moe_inter=32, inter=64, norm_topk=False, tied=False, rope_theta=1000000.0,
         yarn=dict(factor=4.0, original_max_position_embeddings=16), max_pos=64, shards=2,
         prompt_lens=[17, 1, 38], router_margin=0.02,
         notes="qwen3_moe, YaRN (factor 4 over 16 positions), GQA 4:1, head_dim 32 != hidden/heads, "
               "hidden 32 < heads * head_dim, 6 experts top-3 without norm_topk_prob, sharded into 2 files with an index."),
    dict(name="qwen3_dense_tied_bf16", seed=33, model_type="qwen3_moe", dtype="bfloat16",
         vocab=512, hidden=64, layers=3, heads=8, kv_heads=2, head_dim=16, experts=4, top_k=2,
         moe_inter=64, inter=96, norm_topk=True, tied=True, mlp_only_layers=[1],
         prompt_lens=[5, 31, 12],
         notes="qwen3_moe saved in bfloat16 (reference computed in float32 from the bf16 weights), "
               "tied embeddings, layer 1 dense (mlp_only_layers), 4 experts top-2."),
    dict(name="qwen2_shared_bias_f32", seed=44, model_type="qwen2_moe", dtype="float32",
         vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
         moe_inter=32, inter=64, shared_inter=32, norm_topk=False, tied=False, sparse_step=2,
         hf_config=True, prompt_lens=[26, 3, 14, 1],
         notes="qwen2_moe (Qwen1.5-MoE layout): q/k/v bias, shared expert with sigmoid gate, "
               "decoder_sparse_step 2 (layer 0 dense, layer 1 MoE), config.json as "
               "transformers 5 writes it (rope_parameters spelling)."),
    dict(name="qwen3_fp8_block", seed=55, model_type="qwen3_moe", dtype="fp8_block",
         vocab=256, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, experts=4, top_k=2,
         moe_inter=128, inter=128, norm_topk=True, tied=False, prompt_lens=[11, 1, 29],
         notes="FP8 block checkpoint: expert and attention projections float8_e4m3fn with float32 "
               "weight_scale_inv per 128x128 block; embeddings, norms, router and lm_head bf16. "
               "Reference: transformers on the dequantized weights (fp8 * scale_inv) in float32; "
               "the engine computes with the fp8 weights and bf16/f32 activations."),
]

# qwen3_5_moe cases: the multimodal wrapper as published (model_type qwen3_5_moe, the text model
# under text_config, tensors under "model.language_model.", fused experts, a vision tower and an
# MTP head the text model ignores). "compute": "float32" asks the engine to run the bf16
# checkpoint with float32 dense weights and activations, so the case is held to the float32
# tolerance although it is stored as published, in bf16.
CASES.append(
    dict(name="qwen3_5_moe_hybrid", seed=66, model_type="qwen3_5_moe", dtype="bfloat16", compute="float32",
         vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
         moe_inter=32, shared_inter=16, tied=False, max_pos=256, rope_theta=10000000.0,
         linear=dict(k_heads=2, v_heads=4, k_dim=16, v_dim=8, conv=4), router_gain=8.0,
         prompt_lens=[1, 20, 67],
         notes="qwen3_5_moe (Qwen3.5/3.6 MoE) as the multimodal wrapper publishes it: text_config, "
               "tensors under model.language_model., fused experts [E, 2I, H] / [E, H, I], vision and "
               "MTP tensors to ignore; layers 0-2 Gated DeltaNet and layer 3 full attention "
               "(full_attention_interval 4); DeltaNet with 2 key heads serving 4 value heads, key dim "
               "16 != value dim 8, conv kernel 4; attention with the sigmoid output gate, zero-centred "
               "q/k norms, partial rotary 0.25 (4 of 16 dims); 4 experts top-2 (always renormalised) and "
               "the sigmoid-gated shared expert; one prompt longer than the DeltaNet chunk (64). Stored "
               "in bf16; compute float32."))

GREEDY_TOKENS = 16


def is_moe_layer(case, i):
    if i in case.get("mlp_only_layers", []):
        return False
    return case["experts"] > 0 and (i + 1) % case.get("sparse_step", 1) == 0


def qwen3_5_text_config(case):
    """The text_config of a qwen3_5_moe case, spelled as the published Qwen3.5 / 3.6 MoE
    checkpoints spell it (transformers 5 keys, rope_parameters with the multimodal sections)."""
    lin = case["linear"]
    rotary = int(case["head_dim"] * 0.25)
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": case["vocab"],
        "hidden_size": case["hidden"],
        "num_hidden_layers": case["layers"],
        "num_attention_heads": case["heads"],
        "num_key_value_heads": case["kv_heads"],
        "head_dim": case["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": case.get("max_pos", 128),
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": lin["conv"],
        "linear_key_head_dim": lin["k_dim"],
        "linear_value_head_dim": lin["v_dim"],
        "linear_num_key_heads": lin["k_heads"],
        "linear_num_value_heads": lin["v_heads"],
        "mamba_ssm_dtype": "float32",
        "moe_intermediate_size": case["moe_inter"],
        "shared_expert_intermediate_size": case["shared_inter"],
        "num_experts": case["experts"],
        "num_experts_per_tok": case["top_k"],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "mtp_num_hidden_layers": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": case["tied"],
        "dtype": "bfloat16" if case["dtype"] == "bfloat16" else "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": case.get("rope_theta", 10000000.0),
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [rotary // 4, rotary // 4, rotary // 2 - 2 * (rotary // 4)]},
    }


def make_config(case):
    """config.json as published Qwen checkpoints spell it (transformers 4 keys; qwen3_5_moe: the
    multimodal wrapper of transformers 5)."""
    if case["model_type"] == "qwen3_5_moe":
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": case["tied"],
            "text_config": qwen3_5_text_config(case),
            "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 16,
                              "intermediate_size": 32, "num_heads": 2, "out_hidden_size": case["hidden"]},
            "image_token_id": case["vocab"] - 2,
            "video_token_id": case["vocab"] - 1,
        }
    qwen3 = case["model_type"] == "qwen3_moe"
    c = {
        "architectures": ["Qwen3MoeForCausalLM" if qwen3 else "Qwen2MoeForCausalLM"],
        "model_type": case["model_type"],
        "vocab_size": case["vocab"],
        "hidden_size": case["hidden"],
        "intermediate_size": case["inter"],
        "moe_intermediate_size": case["moe_inter"],
        "num_hidden_layers": case["layers"],
        "num_attention_heads": case["heads"],
        "num_key_value_heads": case["kv_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": case.get("max_pos", 128),
        "rms_norm_eps": 1e-6,
        "rope_theta": case.get("rope_theta", 10000.0),
        "rope_scaling": None,
        "tie_word_embeddings": case["tied"],
        "num_experts": case["experts"],
        "num_experts_per_tok": case["top_k"],
        "norm_topk_prob": case["norm_topk"],
        "decoder_sparse_step": case.get("sparse_step", 1),
        "mlp_only_layers": case.get("mlp_only_layers", []),
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": case["layers"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16" if case["dtype"] in ("bfloat16", "fp8_block") else "float32",
    }
    if qwen3:
        c["head_dim"] = case["head_dim"]
        c["attention_bias"] = False
    else:
        if case["hidden"] != case["heads"] * case["head_dim"]:
            raise ValueError(f"{case['name']}: qwen2_moe has head_dim = hidden / heads")
        c["shared_expert_intermediate_size"] = case["shared_inter"]
        c["qkv_bias"] = True
    if "yarn" in case:
        c["rope_scaling"] = {"rope_type": "yarn", **case["yarn"]}
    return c


def make_qwen3_5_weights(case):
    """make_weights() of a qwen3_5_moe case: the multimodal wrapper's tensor names. RMSNorm
    weights are zero-centred (applied as 1 + w), the gated DeltaNet norm's are not; A_log puts
    exp(A_log) in [0.01, 0.5] so that the DeltaNet state decays slowly enough to carry across
    its 64-token chunks; the router's gain spreads its logits (few near-ties)."""
    rng = np.random.default_rng(case["seed"])
    H, V = case["hidden"], case["vocab"]
    hd, nh, nkv = case["head_dim"], case["heads"], case["kv_heads"]
    E, I, S = case["experts"], case["moe_inter"], case["shared_inter"]
    lin_cfg = case["linear"]
    nk, nv, dk, dv, K = lin_cfg["k_heads"], lin_cfg["v_heads"], lin_cfg["k_dim"], lin_cfg["v_dim"], lin_cfg["conv"]
    conv_dim = 2 * nk * dk + nv * dv
    r = hfio.bf16_round

    def lin(out_f, in_f, gain=1.0):
        return r(rng.standard_normal((out_f, in_f)) * (gain / np.sqrt(in_f)))

    def zc_norm(n):
        return r(0.2 * rng.standard_normal(n))

    root = "model.language_model."
    w = {root + "embed_tokens.weight": r(rng.standard_normal((V, H)))}
    config = qwen3_5_text_config(case)
    import qwen_torch
    for i, kind in enumerate(qwen_torch.qwen3_5_layer_types(config)):
        p = f"{root}layers.{i}."
        w[p + "input_layernorm.weight"] = zc_norm(H)
        w[p + "post_attention_layernorm.weight"] = zc_norm(H)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = lin(conv_dim, H)
            w[a + "in_proj_z.weight"] = lin(nv * dv, H)
            w[a + "in_proj_b.weight"] = lin(nv, H)
            w[a + "in_proj_a.weight"] = lin(nv, H)
            w[a + "conv1d.weight"] = r(0.5 * rng.standard_normal((conv_dim, 1, K)))
            w[a + "dt_bias"] = r(0.5 * rng.standard_normal(nv))
            w[a + "A_log"] = r(np.log(rng.uniform(0.01, 0.5, nv)))
            w[a + "norm.weight"] = r(1.0 + 0.2 * rng.standard_normal(dv))
            w[a + "out_proj.weight"] = lin(H, nv * dv)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = lin(nh * hd * 2, H)
            w[a + "k_proj.weight"] = lin(nkv * hd, H)
            w[a + "v_proj.weight"] = lin(nkv * hd, H)
            w[a + "o_proj.weight"] = lin(H, nh * hd)
            w[a + "q_norm.weight"] = zc_norm(hd)
            w[a + "k_norm.weight"] = zc_norm(hd)
        m = p + "mlp."
        w[m + "gate.weight"] = lin(E, H, gain=case.get("router_gain", 2.0))
        w[m + "experts.gate_up_proj"] = np.stack([np.concatenate([lin(I, H), lin(I, H)]) for _ in range(E)])
        w[m + "experts.down_proj"] = np.stack([lin(H, I) for _ in range(E)])
        w[m + "shared_expert.gate_proj.weight"] = lin(S, H)
        w[m + "shared_expert.up_proj.weight"] = lin(S, H)
        w[m + "shared_expert.down_proj.weight"] = lin(H, S)
        w[m + "shared_expert_gate.weight"] = lin(1, H)
    w[root + "norm.weight"] = zc_norm(H)
    if not case["tied"]:
        w["lm_head.weight"] = lin(V, H, gain=2.0)
    # What the published checkpoints carry beside the text model (the engine ignores both).
    w["model.visual.pos_embed.weight"] = r(rng.standard_normal((4, 16)))
    w["model.visual.patch_embed.proj.bias"] = r(rng.standard_normal(16))
    w["mtp.fc.weight"] = lin(H, 2 * H)
    for name, x in w.items():
        assert np.array_equal(hfio.bf16_round(x), x), name
    return w


def make_weights(case):
    """{name: float32 bf16-exact array} in the Hub layout. Scales keep activations O(1) so that
    logits spread well (greedy ties would make the fixture fragile)."""
    if case["model_type"] == "qwen3_5_moe":
        return make_qwen3_5_weights(case)
    rng = np.random.default_rng(case["seed"])
    H, V = case["hidden"], case["vocab"]
    hd, nh, nkv = case["head_dim"], case["heads"], case["kv_heads"]
    qwen3 = case["model_type"] == "qwen3_moe"

    def lin(out_f, in_f, gain=1.0):
        return hfio.bf16_round(rng.standard_normal((out_f, in_f)) * (gain / np.sqrt(in_f)))

    def norm(n):
        return hfio.bf16_round(1.0 + 0.2 * rng.standard_normal(n))

    w = {"model.embed_tokens.weight": hfio.bf16_round(rng.standard_normal((V, H)))}
    for i in range(case["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        a = p + "self_attn."
        w[a + "q_proj.weight"] = lin(nh * hd, H)
        w[a + "k_proj.weight"] = lin(nkv * hd, H)
        w[a + "v_proj.weight"] = lin(nkv * hd, H)
        w[a + "o_proj.weight"] = lin(H, nh * hd)
        if qwen3:
            w[a + "q_norm.weight"] = norm(hd)
            w[a + "k_norm.weight"] = norm(hd)
        else:
            for x, n in (("q", nh), ("k", nkv), ("v", nkv)):
                w[a + f"{x}_proj.bias"] = hfio.bf16_round(0.5 * rng.standard_normal(n * hd))
        m = p + "mlp."
        if is_moe_layer(case, i):
            w[m + "gate.weight"] = lin(case["experts"], H, gain=2.0)
            for e in range(case["experts"]):
                x = m + f"experts.{e}."
                w[x + "gate_proj.weight"] = lin(case["moe_inter"], H)
                w[x + "up_proj.weight"] = lin(case["moe_inter"], H)
                w[x + "down_proj.weight"] = lin(H, case["moe_inter"])
            if not qwen3:
                s = m + "shared_expert."
                w[s + "gate_proj.weight"] = lin(case["shared_inter"], H)
                w[s + "up_proj.weight"] = lin(case["shared_inter"], H)
                w[s + "down_proj.weight"] = lin(H, case["shared_inter"])
                w[m + "shared_expert_gate.weight"] = lin(1, H)
        else:
            w[m + "gate_proj.weight"] = lin(case["inter"], H)
            w[m + "up_proj.weight"] = lin(case["inter"], H)
            w[m + "down_proj.weight"] = lin(H, case["inter"])
    w["model.norm.weight"] = norm(H)
    if not case["tied"]:
        w["lm_head.weight"] = lin(V, H, gain=2.0)
    for name, x in w.items():
        assert np.array_equal(hfio.bf16_round(x), x), name
    return w


def is_fp8_weight(name):
    """Which tensors an FP8-block Qwen3 checkpoint quantizes: every projection of attention, the
    experts and dense MLPs; not embeddings, norms, the router or lm_head."""
    return name.endswith("_proj.weight")


def to_tensors(case, weights):
    """(tensors to save in the case folder, float32 weights the reference runs on)."""
    saved, ref = {}, {}
    for name, x in weights.items():
        if case["dtype"] == "float32":
            saved[name] = hfio.Tensor.f32(x)
            ref[name] = x
        elif case["dtype"] == "bfloat16":
            # A_log in float32 covers a checkpoint that mixes dtypes.
            saved[name] = hfio.Tensor.f32(x) if name.endswith(".A_log") else hfio.Tensor.bf16(x)
            ref[name] = x
        elif case["dtype"] == "fp8_block":
            if is_fp8_weight(name):
                codes, scale_inv, deq = hfio.fp8_block_quantize(x)
                saved[name] = hfio.Tensor.fp8(codes)
                saved[name + "_scale_inv"] = hfio.Tensor.f32(scale_inv)
                ref[name] = deq
            else:
                saved[name] = hfio.Tensor.bf16(x)
                ref[name] = x
        else:
            raise ValueError(case["dtype"])
    return saved, ref


# Smallest gap, in router logits, between the k-th and (k+1)-th expert of any token of a prompt.
# The GPU engine computes every case with bf16 activations (the CPU engine those of bf16 and fp8
# checkpoints); where two experts nearly tie, that rounding may pick the other one, which is a
# legitimate result, yet it moves that token's logits far beyond rounding noise (seen: a 0.004 gap
# flipped in qwen3_fp8_block on the CPU, a 0.005 gap in a float32 case on the GPU).
# Such prompts are drawn again, so the fixture measures rounding, not coin flips. A case may set
# its own `router_margin`: the smallest float32 cases route on logits too small for 0.1 at 40
# tokens, and 0.02 is still four times the gap seen to flip.
ROUTER_MARGIN = 0.1


def min_router_gap(config, ref_weights, prompt):
    """The smallest top-k router-logit gap over all tokens and MoE layers (qwen_torch, float64)."""
    import torch
    import qwen_torch
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(config)
        cfg.pop("quantization_config", None)
        write_json(os.path.join(tmp, "config.json"), cfg)
        model = qwen_torch.load_model(tmp, torch.float64, tensors=ref_weights)
    gaps = []
    k = qwen_torch.text_config(config)["num_experts_per_tok"]

    def hook(mod, inputs, out):
        logits = out[1].sort(dim=-1, descending=True).values
        gaps.append(float((logits[:, k - 1] - logits[:, k]).min()))

    for layer in model.model.layers:
        if layer.moe:
            layer.mlp.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.tensor([prompt], dtype=torch.long))
    return min(gaps) if gaps else float("inf")


def make_prompts(case, config=None, ref_weights=None):
    """Random prompts of case["prompt_lens"] tokens, each drawn again until its routing has no
    near-tie (ROUTER_MARGIN), which needs config and ref_weights."""
    rng = np.random.default_rng(case["seed"] + 1000)
    prompts = []
    for n in case["prompt_lens"]:
        for _ in range(1000):
            p = [int(t) for t in rng.integers(0, case["vocab"], n)]
            if config is None or \
                    min_router_gap(config, ref_weights, p) >= case.get("router_margin", ROUTER_MARGIN):
                break
        else:
            raise RuntimeError(f"{case['name']}: no prompt of {n} tokens without a router near-tie")
        prompts.append(p)
    return prompts


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def write_float32_reference_folder(case, config, ref_weights, folder):
    """A folder transformers loads as a case's float32 reference: the reference weights as
    float32 (bf16 values exactly, fp8 ones dequantized), no quantization_config. A qwen3_5_moe
    case becomes its text model alone (Qwen3_5MoeForCausalLM: the text_config as model_type
    qwen3_5_moe_text, tensors renamed from "model.language_model." to "model.", vision and MTP
    tensors dropped), which computes on text what the multimodal wrapper computes."""
    cfg = dict(config)
    cfg.pop("quantization_config", None)
    tensors = ref_weights
    if case["model_type"] == "qwen3_5_moe":
        import qwen_torch
        cfg = dict(config["text_config"], architectures=["Qwen3_5MoeForCausalLM"],
                   model_type="qwen3_5_moe_text", dtype="float32")
        tensors = qwen_torch.qwen3_5_text_tensors(ref_weights)
    else:
        cfg["torch_dtype"] = "float32"
    write_json(os.path.join(folder, "config.json"), cfg)
    hfio.write_checkpoint(folder, {k: hfio.Tensor.f32(v) for k, v in tensors.items()})


def compute_dtype(case):
    """What the engine computes a case in: float32 for float32 checkpoints and for cases that ask
    for it ("compute"), else the checkpoint's dtype (bf16 activations)."""
    return case.get("compute", case["dtype"])


def check_delta_rule_forms(case, model, prompts, log):
    """qwen3_5_moe: the chunked gated delta rule (transformers' prefill form, chunks of 64) and
    the recurrent one (its decode form) must give the same logits; in float64 they agree to
    rounding. Raises if they do not. Returns the largest difference over max |logit|."""
    import torch
    worst = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long)
            model.set_delta_rule("chunk")
            chunk = model(ids)[0][0].numpy()
            model.set_delta_rule("recurrent")
            recurrent = model(ids)[0][0].numpy()
            model.set_delta_rule("chunk")
            worst = max(worst, float(np.abs(chunk - recurrent).max() / np.abs(chunk).max()))
    log(f"  chunked vs recurrent delta rule: max diff / max |logit| = {worst:.3g}")
    if not worst <= 1e-10:
        raise RuntimeError(f"{case['name']}: chunked and recurrent delta rules differ ({worst:.3g})")
    return worst


def hf_reference(case, folder, ref_folder, prompts, log):
    """Runs transformers on ref_folder (float32 weights) and returns the reference.json fields
    and the per-prompt logits."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    torch.set_num_threads(16)
    torch.use_deterministic_algorithms(True)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(ref_folder, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError) as e:
        log(f"  experts_implementation=eager not accepted ({e}); default experts implementation")
        model, info = AutoModelForCausalLM.from_pretrained(ref_folder, **kwargs)
    bad = {k: [x for x in v if not (case["tied"] and "lm_head" in str(x))] for k, v in info.items()
           if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        raise RuntimeError(f"{case['name']}: transformers did not load every tensor: {bad}")
    model.eval()
    # The loaded embedding must be ours bit for bit (guards against a silent re-initialization).
    emb = model.get_input_embeddings().weight.detach().numpy()
    want = hfio.bf16_round(np.random.default_rng(case["seed"]).standard_normal((case["vocab"], case["hidden"])))
    if not np.array_equal(emb, want):
        raise RuntimeError(f"{case['name']}: transformers' embedding differs from the checkpoint")

    logits = []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([p], dtype=torch.long)).logits[0].float().numpy()
            logits.append(np.ascontiguousarray(out, dtype=np.float32))
    # Greedy continuations of the two prompts whose argmax margins are largest (robust fixture).
    greedy = []
    greedy_note = ""
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], dtype=torch.long)
            gc = GenerationConfig(max_new_tokens=GREEDY_TOKENS, do_sample=False, num_beams=1,
                                  eos_token_id=None, pad_token_id=0, use_cache=True)
            try:
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
                out = [int(t) for t in gen[0, len(p):]]
            except Exception as e:  # fall back to argmax steps of full forwards, and say so
                log(f"  WARNING: generate failed ({type(e).__name__}: {e}); greedy by full forwards")
                out = []
            if len(out) != GREEDY_TOKENS:
                seq = list(p)
                for _ in range(GREEDY_TOKENS):
                    seq.append(int(model(torch.tensor([seq], dtype=torch.long)).logits[0, -1].argmax()))
                out = seq[len(p):]
                greedy_note = " (generate unavailable: argmax of full forwards)"
            # Cross-check against a full teacher-forced pass (no KV cache): same argmax.
            full = model(torch.tensor([p + out], dtype=torch.long)).logits[0].float().numpy()
            steps = full[len(p) - 1:len(p) - 1 + GREEDY_TOKENS]
            argmax = [int(t) for t in steps.argmax(-1)]
            top2 = np.sort(steps, axis=-1)[:, -2:]
            margin = float(np.min(top2[:, 1] - top2[:, 0]))
            log(f"  prompt {i} (len {len(p)}): greedy {out} min top-2 margin {margin:.4g}"
                + ("" if argmax == out else f"  MISMATCH with full pass {argmax}"))
            greedy.append(dict(prompt=p, output=out, margin=margin, consistent=argmax == out))
    candidates = sorted([g for g in greedy if g["consistent"]], key=lambda g: -g["margin"])[:2]
    if len(candidates) < 2:
        raise RuntimeError(f"{case['name']}: fewer than 2 prompts have a consistent greedy output")
    candidates.sort(key=lambda g: prompts.index(g["prompt"]))
    ref = {
        "prompts": prompts,
        "greedy": [dict(prompt=g["prompt"], output=g["output"]) for g in candidates],
        "dtype": case["dtype"],
        **({"compute": case["compute"]} if "compute" in case else {}),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "notes": case["notes"] + (" Logits: transformers {}, torch {} on the CPU, float32, eager "
                                  "attention, one prompt per forward. Greedy: model.generate("
                                  "do_sample=False, no EOS){}, min top-2 logit margin {:.3g}.").format(
            transformers.__version__, torch.__version__, greedy_note, min(g["margin"] for g in candidates)),
    }
    return ref, logits


def torch_reference(case, config, ref_weights, prompts, log):
    """hf_reference() computed with qwen_torch (transformers' modeling code in PyTorch) in float64
    from the float32 reference weights; logits stored as float32. Greedy continuations are the
    argmax of a full forward (no KV cache) at each step."""
    import torch
    import qwen_torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ref_config = dict(config)
        ref_config.pop("quantization_config", None)
        write_json(os.path.join(tmp, "config.json"), ref_config)
        model = qwen_torch.load_model(tmp, torch.float64, tensors=ref_weights)
    emb = model.model.embed_tokens.weight.detach().numpy()
    want = hfio.bf16_round(np.random.default_rng(case["seed"]).standard_normal((case["vocab"], case["hidden"])))
    if not np.array_equal(emb, want):
        raise RuntimeError(f"{case['name']}: the loaded embedding differs from the checkpoint")

    def forward(ids):
        with torch.no_grad():
            return model(torch.tensor([ids], dtype=torch.long))[0][0].numpy()

    logits = [np.ascontiguousarray(forward(p), dtype=np.float32) for p in prompts]
    forms_note = ""
    if case["model_type"] == "qwen3_5_moe":
        worst = check_delta_rule_forms(case, model, prompts, log)
        forms_note = (" The chunked (64-token chunks) and recurrent forms of the gated delta rule agree to "
                      "{:.2g} of the largest logit.").format(worst)
    greedy = []
    for i, p in enumerate(prompts):
        out = qwen_torch.greedy(model, p, GREEDY_TOKENS)
        # Cross-check against one teacher-forced pass over prompt + output: same argmax.
        steps = forward(p + out)[len(p) - 1:len(p) - 1 + GREEDY_TOKENS]
        argmax = [int(t) for t in steps.argmax(-1)]
        top2 = np.sort(steps, axis=-1)[:, -2:]
        margin = float(np.min(top2[:, 1] - top2[:, 0]))
        log(f"  prompt {i} (len {len(p)}): greedy {out} min top-2 margin {margin:.4g}"
            + ("" if argmax == out else f"  MISMATCH with full pass {argmax}"))
        greedy.append(dict(prompt=p, output=out, margin=margin, consistent=argmax == out))
    candidates = sorted([g for g in greedy if g["consistent"]], key=lambda g: -g["margin"])[:2]
    if len(candidates) < 2:
        raise RuntimeError(f"{case['name']}: fewer than 2 prompts have a consistent greedy output")
    candidates.sort(key=lambda g: prompts.index(g["prompt"]))
    ref = {
        "prompts": prompts,
        "greedy": [dict(prompt=g["prompt"], output=g["output"]) for g in candidates],
        "dtype": case["dtype"],
        **({"compute": case["compute"]} if "compute" in case else {}),
        "backend": "torch",
        "torch": torch.__version__,
        "notes": case["notes"] + (" Logits: tools/reference/qwen_torch.py, a PyTorch implementation of "
                                  "transformers' {} modeling code (eager attention), torch {} on the CPU in "
                                  "float64 from the float32 weights, stored as float32, one prompt per forward; "
                                  "make_fixtures.py --backend hf reproduces them with transformers itself. "
                                  "Greedy: argmax of a full forward at each step (no EOS), min top-2 logit "
                                  "margin {:.3g}.").format(case["model_type"], torch.__version__,
                                                           min(g["margin"] for g in candidates)) + forms_note,
    }
    return ref, logits


def transformers5_config(config):
    """config.json as transformers 5's save_pretrained writes a Qwen2MoeConfig (to_diff_dict:
    the keys that differ from the class defaults, RoPE as rope_parameters, dtype for torch_dtype,
    layer_types), for the torch backend, which cannot call transformers."""
    assert config["model_type"] == "qwen2_moe"
    defaults = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=16, hidden_act="silu",
                    max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                    tie_word_embeddings=False, use_sliding_window=False, max_window_layers=28,
                    attention_dropout=0.0, decoder_sparse_step=1, moe_intermediate_size=1408,
                    shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                    norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001,
                    mlp_only_layers=[], qkv_bias=True)
    out = {"architectures": config["architectures"], "model_type": config["model_type"],
           "dtype": config["torch_dtype"]}
    for k, v in config.items():
        if k in defaults and defaults[k] != v:
            out[k] = v
    out["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    out["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    return dict(sorted(out.items()))


def build_case(case, out_root, use_hf, log, backend="hf"):
    folder = os.path.join(out_root, case["name"])
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    config = make_config(case)
    weights = make_weights(case)
    saved, ref_weights = to_tensors(case, weights)
    if case["dtype"] == "fp8_block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic"}
    write_json(os.path.join(folder, "config.json"), config)
    hfio.write_checkpoint(folder, saved, shards=case.get("shards", 1))
    prompts = make_prompts(case, config, ref_weights)
    if not use_hf:
        write_json(os.path.join(folder, "reference.json"), {"prompts": prompts, "dtype": case["dtype"],
                                                            "notes": "files only (--no-hf): no logits"})
        return
    if backend == "torch":
        ref, logits = torch_reference(case, config, ref_weights, prompts, log)
        if case.get("hf_config"):
            write_json(os.path.join(folder, "config.json"), transformers5_config(config))
        write_json(os.path.join(folder, "reference.json"), ref)
        for i, x in enumerate(logits):
            assert x.shape == (len(prompts[i]), case["vocab"]), x.shape
            np.save(os.path.join(folder, f"logits_{i}.npy"), x)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ref_folder = folder
        if case["dtype"] != "float32" or case["model_type"] == "qwen3_5_moe":
            # transformers computes from float32 weights: the bf16 values exactly, the fp8 ones
            # dequantized. No quantization_config there: the values are already real.
            ref_folder = tmp
            write_float32_reference_folder(case, config, ref_weights, tmp)
        ref, logits = hf_reference(case, folder, ref_folder, prompts, log)
    if case.get("hf_config"):
        # config.json as transformers 5 writes it (rope_parameters, dtype, layer_types).
        from transformers import AutoConfig
        hf = AutoConfig.from_pretrained(folder)
        hf.save_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            written = json.load(f)
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            written.pop(key, None)  # no EOS: greedy runs the full length on both sides
        write_json(os.path.join(folder, "config.json"), written)
        gen = os.path.join(folder, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)
    write_json(os.path.join(folder, "reference.json"), ref)
    for i, x in enumerate(logits):
        assert x.shape == (len(prompts[i]), case["vocab"]), x.shape
        np.save(os.path.join(folder, f"logits_{i}.npy"), x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output root (engine/testdata)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--no-hf", action="store_true", help="write checkpoints only (no transformers)")
    ap.add_argument("--backend", choices=["hf", "torch"], default=None,
                    help="hf: transformers; torch: qwen_torch.py in float64 (default when transformers "
                         "is absent)")
    args = ap.parse_args()
    if args.backend is None:
        import importlib.util
        args.backend = "hf" if importlib.util.find_spec("transformers") else "torch"
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    wanted = [c for c in args.cases.split(",") if c]
    unknown = set(wanted) - {c["name"] for c in CASES}
    if unknown:
        sys.exit(f"unknown case(s): {sorted(unknown)}")
    failed = []
    for case in CASES:
        if wanted and case["name"] not in wanted:
            continue
        t0 = time.time()
        log(f"{case['name']}:")
        try:
            build_case(case, args.out, not args.no_hf, log, args.backend)
            log(f"  done in {time.time() - t0:.1f} s")
        except Exception as e:  # one broken case must not cost the others (one device call)
            import traceback
            traceback.print_exc()
            failed.append(case["name"])
            log(f"  FAILED: {e}")
    if failed:
        sys.exit(f"failed cases: {failed}")


if __name__ == "__main__":
    main()
