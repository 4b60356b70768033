"""A plain PyTorch implementation of Hugging Face transformers' qwen3_moe and qwen2_moe models
(modeling_qwen3_moe.py, modeling_qwen2_moe.py, and the "default" and "yarn" RoPE of
modeling_rope_utils.py), for machines where transformers cannot be installed.

It follows transformers' eager code path line by line: RMSNorm computed in (at least) float32 and
cast back, q/k RMSNorm over head_dim before RoPE (qwen3_moe), q/k/v bias (qwen2_moe), rotate_half
RoPE, eager attention (scores * head_dim**-0.5, additive causal mask, GQA by repeat_kv, softmax in
(at least) float32), the router (softmax in float32 over the logits, top-k, renormalised when
norm_topk_prob, cast back), experts down(silu(gate(x)) * up(x)), the qwen2_moe shared expert
sigmoid(shared_expert_gate(x)) * shared_expert(x), decoder_sparse_step / mlp_only_layers, tied
embeddings, and the load-balancing loss used in training. "At least float32" means that a model
run in float64 keeps float64 where transformers upcasts to float32, so a float64 run is the exact
mathematical function with no rounding in between.

Parameter names are the Hub's (per-expert tensors), so state_dict() keys are checkpoint names.
`tools/reference/*.py --backend hf` run transformers itself on the same checkpoints.
Not thread-safe (torch modules); a model owns its parameters.
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _up(dtype):
    """transformers' float32 upcast, kept wider for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x):
        input_dtype = x.dtype
        x = x.to(_up(input_dtype))
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


def rope_config(cfg):
    """(rope_theta, rope_scaling dict or None) from either spelling: transformers 4's rope_theta +
    rope_scaling, or transformers 5's rope_parameters."""
    params = cfg.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rtype = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rtype == "default" else dict(params, rope_type=rtype))
    scaling = cfg.get("rope_scaling")
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rtype == "default" else dict(scaling, rope_type=rtype)
    return cfg.get("rope_theta", 10000.0), scaling


def compute_inv_freq(cfg, head_dim):
    """(inv_freq float32 [head_dim / 2], attention_scaling): _compute_default_rope_parameters and
    _compute_yarn_parameters of modeling_rope_utils.py."""
    base, scaling = rope_config(cfg)
    dim = int(head_dim * cfg.get("partial_rotary_factor", 1.0))
    if scaling is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        return inv_freq, 1.0
    if scaling["rope_type"] != "yarn":
        raise ValueError(f"rope type {scaling['rope_type']!r} is not implemented")
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    original_max_position_embeddings = (scaling.get("original_max_position_embeddings")
                                        or cfg["max_position_embeddings"])

    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min_, max_, dim):
        if min_ == max_:
            max_ += 0.001  # prevents a division by zero
        linear_func = (torch.arange(dim, dtype=torch.float32) - min_) / (max_ - min_)
        return torch.clamp(linear_func, 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    truncate = scaling.get("truncate", True)
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2).to(dtype=torch.float)
    inv_freq = (inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
                + inv_freq_extrapolation * inv_freq_extrapolation_factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg, head_dim):
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(cfg, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        # transformers computes the angles in float32 (autocast disabled) and casts cos/sin to x's
        # dtype; a float64 run keeps float64 angles from the same float32 inv_freq.
        wide = _up(x.dtype)
        inv = self.inv_freq[None, :, None].to(wide).expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].to(wide)
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.qwen3 = cfg["model_type"] == "qwen3_moe"
        H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or H // nh
        self.num_key_value_groups = nh // nkv
        self.scaling = self.head_dim ** -0.5
        # qwen2_moe: q/k/v always carry a bias; qwen3_moe: attention_bias on all four.
        qkv_bias = cfg.get("attention_bias", False) if self.qwen3 else cfg.get("qkv_bias", True)
        o_bias = cfg.get("attention_bias", False) if self.qwen3 else False
        self.q_proj = nn.Linear(H, nh * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(H, nkv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(H, nkv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(nh * self.head_dim, H, bias=o_bias)
        if self.qwen3:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(x).view(hidden_shape)
        k = self.k_proj(x).view(hidden_shape)
        if self.qwen3:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(hidden_shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # eager_attention_forward
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = w + mask[:, :, :, : k.shape[-2]]
        w = F.softmax(w, dim=-1, dtype=_up(q.dtype)).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H = cfg["hidden_size"]
        self.num_experts = cfg["num_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        # qwen2_moe's config defaults norm_topk_prob to False, qwen3_moe's to False as well.
        self.norm_topk_prob = cfg.get("norm_topk_prob", False)
        self.gate = nn.Linear(H, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MLP(H, cfg["moe_intermediate_size"]) for _ in range(self.num_experts)])
        self.shared = cfg["model_type"] == "qwen2_moe"
        if self.shared:
            self.shared_expert = MLP(H, cfg["shared_expert_intermediate_size"])
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=_up(hidden_states.dtype))
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[e])
            if top_x.numel() == 0:
                continue
            cur = self.experts[e](hidden_states[top_x]) * routing_weights[top_x, idx, None]
            final = final.index_add(0, top_x, cur.to(hidden_states.dtype))
        if self.shared:
            shared = self.shared_expert(hidden_states)
            final = final + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


def is_moe_layer(cfg, i):
    return (i not in (cfg.get("mlp_only_layers") or [])
            and cfg["num_experts"] > 0 and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Attention(cfg)
        self.moe = is_moe_layer(cfg, i)
        self.mlp = SparseMoeBlock(cfg) if self.moe else MLP(H, cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        if self.moe:
            h, logits = self.mlp(h)
        else:
            h, logits = self.mlp(h), None
        return x + h, logits


class Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary_emb = RotaryEmbedding(cfg, head_dim)


class MoeForCausalLM(nn.Module):
    """Qwen3MoeForCausalLM / Qwen2MoeForCausalLM. forward(ids [B, T]) -> (logits [B, T, V], list
    of router logits [B*T, E] per MoE layer)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg["model_type"] not in ("qwen3_moe", "qwen2_moe"):
            raise ValueError(f"model_type {cfg['model_type']!r} is not implemented")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not implemented")
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.tied = cfg.get("tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def init_weights(self, seed):
        """transformers' _init_weights: normal(0, initializer_range) for Linear and Embedding,
        zero biases, ones for RMSNorm."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.get("initializer_range", 0.02)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()

    def head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        T = ids.shape[1]
        position_ids = torch.arange(T)[None, :].expand(ids.shape[0], -1)
        cos, sin = self.model.rotary_emb(x, position_ids)
        # The causal mask as transformers builds it for eager attention: 0 where attended, the
        # dtype's minimum above the diagonal.
        mask = torch.full((T, T), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        router_logits = []
        for layer in self.model.layers:
            x, logits = layer(x, cos, sin, mask)
            if logits is not None:
                router_logits.append(logits)
        x = self.model.norm(x)
        return F.linear(x, self.head_weight()), router_logits


def load_balancing_loss(router_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func without an attention mask."""
    gate_logits = torch.cat(router_logits, dim=0)
    routing_weights = F.softmax(gate_logits, dim=-1)
    _, selected = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


# --- checkpoints ---------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "I64": np.int64}


def read_safetensors(path):
    """{name: float32 numpy array} of one safetensors file (F32, F16, BF16)."""
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        raw = data[a:b]
        if h["dtype"] == "BF16":
            x = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] in _ST_DTYPES:
            x = np.frombuffer(raw, dtype=_ST_DTYPES[h["dtype"]]).astype(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {h['dtype']}, not handled here")
        out[name] = x.reshape(h["shape"])
    return out


def read_checkpoint(folder):
    """All tensors of a model folder (model.safetensors or the shards of its index)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        out.update(read_safetensors(os.path.join(folder, name)))
    return out


def load_model(folder, dtype=torch.float64, tensors=None):
    """The model of a folder (config.json + safetensors) in `dtype`, in eval mode. Every
    checkpoint tensor must be used and every parameter set (a tied lm_head may be absent).
    `tensors` replaces the folder's weights (e.g. dequantized FP8)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    model = MoeForCausalLM(cfg)
    if tensors is None:
        tensors = read_checkpoint(folder)
    params = dict(model.named_parameters())
    extra = sorted(set(tensors) - set(params) - ({"lm_head.weight"} if model.tied else set()))
    missing = sorted(set(params) - set(tensors))
    if extra or missing:
        raise ValueError(f"{folder}: unexpected tensors {extra[:5]}, missing {missing[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            t = torch.from_numpy(np.ascontiguousarray(tensors[name]))
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.copy_(t)
    return model.to(dtype).eval()


def greedy(model, prompt, n):
    """n greedy tokens after prompt, EOS ignored: the argmax of a full forward (no KV cache) at
    each step, as transformers' generate(do_sample=False) chooses them."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]
