"""A plain PyTorch implementation of Hugging Face transformers' qwen3_moe, qwen2_moe and
qwen3_5_moe models (modeling_qwen3_moe.py, modeling_qwen2_moe.py, modeling_qwen3_5_moe.py, and the
"default" and "yarn" RoPE of modeling_rope_utils.py), for machines where transformers cannot be
installed.

It follows transformers' eager code path line by line: RMSNorm computed in (at least) float32 and
cast back, q/k RMSNorm over head_dim before RoPE (qwen3_moe), q/k/v bias (qwen2_moe), rotate_half
RoPE, eager attention (scores * head_dim**-0.5, additive causal mask, GQA by repeat_kv, softmax in
(at least) float32), the router (softmax in float32 over the logits, top-k, renormalised when
norm_topk_prob, cast back), experts down(silu(gate(x)) * up(x)), the qwen2_moe shared expert
sigmoid(shared_expert_gate(x)) * shared_expert(x), decoder_sparse_step / mlp_only_layers, tied
embeddings, and the load-balancing loss used in training. "At least float32" means that a model
run in float64 keeps float64 where transformers upcasts to float32, so a float64 run is the exact
mathematical function with no rounding in between.

qwen3_5_moe (Qwen3.5 / Qwen3.6 MoE, the text model of Qwen3_5MoeForConditionalGeneration): layers
of two kinds after layer_types or the full_attention_interval rule. Gated DeltaNet layers:
in_proj_qkv, a causal depthwise conv1d with SiLU, beta = sigmoid(in_proj_b(x)),
g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias), the gated delta rule over L2-normalised q and
k (q scaled by k_head_dim**-0.5; each key head serves consecutive value heads) in transformers'
chunked form (torch_chunk_gated_delta_rule, 64-token chunks) or its recurrent form
(torch_recurrent_gated_delta_rule), RMSNormGated with in_proj_z, out_proj. Full-attention layers:
q_proj giving per head the query then an output gate, zero-centred q/k norms, partial rotary
(partial_rotary_factor of head_dim, rotate_half within it), eager attention, output times
sigmoid(gate). Every RMSNorm but the DeltaNet's applies its weight as (1 + weight). Every layer is
a MoE block whose router always renormalises its top-k, with a sigmoid-gated shared expert; fused
experts. Text positions are plain (the multimodal RoPE sections coincide for text).

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


# --- qwen3_5_moe (modeling_qwen3_5_moe.py): Gated DeltaNet hybrid, gated attention ----------------

QWEN3_5_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def text_config(cfg):
    """The language model's config: a multimodal wrapper's text_config (with the wrapper's
    tie_word_embeddings where the text config has none), or cfg itself. model_type is normalised
    to "qwen3_5_moe" for either spelling of the family."""
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        tc = dict(cfg["text_config"])
        if "tie_word_embeddings" not in tc and "tie_word_embeddings" in cfg:
            tc["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        tc.setdefault("model_type", cfg.get("model_type"))
        cfg = tc
    if cfg.get("model_type") in QWEN3_5_MOE_TYPES:
        cfg = dict(cfg, model_type="qwen3_5_moe")
    return cfg


def qwen3_5_layer_types(cfg):
    """layer_types as Qwen3_5MoeTextConfig.__post_init__ derives them: the explicit list, or every
    full_attention_interval-th layer (default 4) full attention, the others linear attention."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    interval = cfg.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(cfg["num_hidden_layers"])]


def qwen3_5_partial_rotary_factor(cfg):
    """partial_rotary_factor from rope_parameters, else the config's own field, else the family's
    default 0.25 (Qwen3_5MoeTextConfig sets it when absent)."""
    params = cfg.get("rope_parameters") or {}
    if params.get("partial_rotary_factor") is not None:
        return params["partial_rotary_factor"]
    return cfg.get("partial_rotary_factor", 0.25)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3_5MoeRMSNorm: the weight is stored zero-centred and applied as (1 + weight), the
    product taken in float32 (or wider) before the cast back."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        up = _up(x.dtype)
        h = x.to(up)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h * (1.0 + self.weight.to(up))
        return h.type_as(x)


class GatedRMSNorm(nn.Module):
    """Qwen3_5MoeRMSNormGated: RMSNorm over the value head with a plain weight, then times
    silu(gate) in float32 (or wider)."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x, gate):
        input_dtype = x.dtype
        up = _up(input_dtype)
        x = x.to(up)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = self.weight * x.to(input_dtype)
        x = x * F.silu(gate.to(up))
        return x.to(input_dtype)


def l2norm(x, dim=-1, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False):
    """transformers' torch_chunk_gated_delta_rule: the gated delta rule over chunks of chunk_size
    tokens (a UT transform per chunk, a sequential scan over chunks). query/key [B, T, Hk, Dk],
    value [B, T, Hv, Dv], g/beta [B, T, Hv]; key heads serve Hv / Hk consecutive value heads.
    Computes in float32, or float64 for float64 inputs."""
    initial_dtype = query.dtype
    wide = _up(initial_dtype)
    batch_size, sequence_length, _, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if key.shape[2] != num_v_heads:
        query, key = (x.repeat_interleave(num_v_heads // x.shape[2], dim=2) for x in (query, key))
    recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
    decay = g
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(wide).contiguous() for x in (query, key, value, beta, decay)]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5

    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    total_sequence_length = sequence_length + pad_size
    num_chunks = total_sequence_length // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise_decay = pairwise_decay.masked_fill(strictly_upper_mask, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=new_values.dtype)
    else:
        last_recurrent_state = initial_state.to(new_values)
    core_attn_out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ last_recurrent_state
        inter_chunk_attn = query[:, :, i] @ last_recurrent_state
        core_attn_out[:, :, i] = inter_chunk_attn + intra_chunk_attn[:, :, i] @ v_new
        last_recurrent_state = last_recurrent_state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.reshape(batch_size, num_v_heads, -1, v_head_dim)[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


def torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False):
    """transformers' torch_recurrent_gated_delta_rule: the same rule one token at a time (what a
    decode step computes). Same arguments as the chunked form, without chunk_size."""
    initial_dtype = query.dtype
    wide = _up(initial_dtype)
    batch_size, sequence_length, _, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if key.shape[2] != num_v_heads:
        query, key = (x.repeat_interleave(num_v_heads // x.shape[2], dim=2) for x in (query, key))
    decay = g
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(wide).contiguous() for x in (query, key, value, beta, decay)]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    if initial_state is None:
        last_recurrent_state = torch.zeros((batch_size, num_v_heads, k_head_dim, v_head_dim), dtype=value.dtype)
    else:
        last_recurrent_state = initial_state.to(value)
    core_attn_out = torch.zeros_like(value)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        last_recurrent_state = last_recurrent_state * decay[:, :, i].exp()[..., None, None]
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


# The DeltaNet chunk length transformers' torch_chunk_gated_delta_rule uses by default.
DELTA_CHUNK_SIZE = 64


class GatedDeltaNet(nn.Module):
    """Qwen3_5MoeGatedDeltaNet without a cache (a whole sequence per forward): in_proj_qkv ->
    causal depthwise conv1d (kernel linear_conv_kernel_dim, no bias) + SiLU -> q, k, v; beta =
    sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias); the gated delta
    rule with L2-normalised q and k (q scaled by k_head_dim**-0.5); RMSNormGated with
    z = in_proj_z(x); out_proj. `delta_rule` picks the chunked ("chunk", what transformers runs
    on a prompt) or the token-by-token ("recurrent", what a decode step runs) form."""

    def __init__(self, cfg):
        super().__init__()
        H = cfg["hidden_size"]
        self.num_v_heads = cfg["linear_num_value_heads"]
        self.num_k_heads = cfg["linear_num_key_heads"]
        self.head_k_dim = cfg["linear_key_head_dim"]
        self.head_v_dim = cfg["linear_value_head_dim"]
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = cfg["linear_conv_kernel_dim"]
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, bias=False, kernel_size=self.conv_kernel_size,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg["rms_norm_eps"])
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        self.delta_rule = "chunk"

    def forward(self, x):
        batch_size, seq_len, _ = x.shape
        mixed_qkv = self.in_proj_qkv(x).transpose(1, 2)
        z = self.in_proj_z(x).reshape(batch_size, seq_len, -1, self.head_v_dim)
        b = self.in_proj_b(x)
        a = self.in_proj_a(x)
        # causal_conv1d_fn: left padding kernel - 1, the first seq_len outputs, then SiLU.
        mixed_qkv = F.conv1d(mixed_qkv, self.conv1d.weight, None, padding=self.conv_kernel_size - 1,
                             groups=self.conv_dim)[:, :, :seq_len]
        mixed_qkv = F.silu(mixed_qkv).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)
        beta = b.sigmoid()
        up = _up(x.dtype)
        g = -self.A_log.to(up).exp() * F.softplus(a.to(up) + self.dt_bias)
        if self.delta_rule == "chunk":
            core, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, chunk_size=DELTA_CHUNK_SIZE,
                                                   use_qk_l2norm_in_kernel=True)
        elif self.delta_rule == "recurrent":
            core, _ = torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta,
                                                       use_qk_l2norm_in_kernel=True)
        else:
            raise ValueError(f"delta_rule {self.delta_rule!r}")
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(batch_size, seq_len, -1))


def apply_partial_rotary_pos_emb(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb of qwen3_5_moe: rotate_half over the first
    cos.shape[-1] dimensions of each head, the rest passed through."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


class GatedAttention(nn.Module):
    """Qwen3_5MoeAttention: q_proj gives, per head, head_dim query values then head_dim gate
    values; zero-centred q/k RMSNorm over head_dim; partial RoPE; eager GQA attention; the output
    times sigmoid(gate) before o_proj."""

    def __init__(self, cfg):
        super().__init__()
        H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        if cfg.get("attention_bias", False):
            raise ValueError("attention_bias is not implemented for qwen3_5_moe")
        self.head_dim = cfg.get("head_dim") or H // nh
        self.num_key_value_groups = nh // nkv
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(H, nh * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(H, nkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, nkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.head_dim, H, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, gate = torch.chunk(self.q_proj(x).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        q = self.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(x).view(hidden_shape).transpose(1, 2)
        q, k = apply_partial_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = w + mask[:, :, :, : k.shape[-2]]
        w = F.softmax(w, dim=-1, dtype=_up(q.dtype)).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        out = out.reshape(*input_shape, -1).contiguous()
        out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class Qwen3_5MoeExperts(nn.Module):
    """Qwen3_5MoeExperts: fused gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj
    [E, H, I], the layout of the published checkpoints."""

    def __init__(self, cfg):
        super().__init__()
        E, H, I = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            top_k_pos, token_idx = torch.where(expert_mask[e])
            if token_idx.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            cur = F.linear(F.silu(gate) * up, self.down_proj[e])
            cur = cur * top_k_weights[token_idx, top_k_pos, None]
            final = final.index_add(0, token_idx, cur.to(final.dtype))
        return final


class Qwen3_5MoeSparseMoeBlock(nn.Module):
    """Qwen3_5MoeSparseMoeBlock: the router (softmax in float32 or wider, top-k, ALWAYS
    renormalised over the top-k whatever norm_topk_prob says, cast back), the routed experts and
    the shared expert times sigmoid(shared_expert_gate(x)). Returns (output, router logits)."""

    def __init__(self, cfg):
        super().__init__()
        H = cfg["hidden_size"]
        self.top_k = cfg["num_experts_per_tok"]
        self.gate = nn.Linear(H, cfg["num_experts"], bias=False)
        self.experts = Qwen3_5MoeExperts(cfg)
        self.shared_expert = MLP(H, cfg["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        x = hidden_states.view(-1, hidden_dim)
        shared = self.shared_expert(x)
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dtype=_up(x.dtype), dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        top_value = top_value.to(router_logits.dtype)
        out = self.experts(x, top_index, top_value)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_type):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        elif layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg)
        else:
            raise ValueError(f"layer type {layer_type!r} is not implemented")
        self.moe = True
        self.mlp = Qwen3_5MoeSparseMoeBlock(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(H, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(H, eps)

    def forward(self, x, cos, sin, mask):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h)
        else:
            h = self.self_attn(h, cos, sin, mask)
        x = x + h
        h, logits = self.mlp(self.post_attention_layernorm(x))
        return x + h, logits


class Qwen3_5Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, t) for t in qwen3_5_layer_types(cfg)])
        self.norm = ZeroCenteredRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary_emb = RotaryEmbedding(dict(cfg, partial_rotary_factor=qwen3_5_partial_rotary_factor(cfg)),
                                          head_dim)


class Qwen3_5MoeForCausalLM(nn.Module):
    """Qwen3_5MoeForCausalLM (the text model of Qwen3_5MoeForConditionalGeneration). Text
    positions are plain: the multimodal RoPE sections rotate by the same position for text, so
    they reduce to one position per token. forward(ids [B, T]) -> (logits [B, T, V], list of
    router logits [B*T, E] per layer). Parameter names are Qwen3_5MoeForCausalLM's ("model.",
    "lm_head."); load_model maps the wrapper's "model.language_model." onto them."""

    def __init__(self, cfg):
        super().__init__()
        cfg = text_config(cfg)
        if cfg["model_type"] != "qwen3_5_moe":
            raise ValueError(f"model_type {cfg['model_type']!r} is not qwen3_5_moe")
        layer_types = qwen3_5_layer_types(cfg)
        if len(layer_types) != cfg["num_hidden_layers"]:
            raise ValueError("layer_types must have num_hidden_layers entries")
        self.cfg = cfg
        self.model = Qwen3_5Backbone(cfg)
        self.tied = cfg.get("tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def set_delta_rule(self, rule):
        """"chunk" (transformers' prefill form) or "recurrent" (its decode form) in every
        Gated DeltaNet layer."""
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.delta_rule = rule

    def head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        T = ids.shape[1]
        position_ids = torch.arange(T)[None, :].expand(ids.shape[0], -1)
        cos, sin = self.model.rotary_emb(x, position_ids)
        mask = torch.full((T, T), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        router_logits = []
        for layer in self.model.layers:
            x, logits = layer(x, cos, sin, mask)
            router_logits.append(logits)
        x = self.model.norm(x)
        return F.linear(x, self.head_weight()), router_logits


def is_qwen3_5_moe(cfg):
    return cfg.get("model_type") in QWEN3_5_MOE_TYPES


# Tensors of a published qwen3_5_moe checkpoint that the text model does not use: the vision
# tower and the multi-token-prediction head.
QWEN3_5_IGNORED_PREFIXES = ("model.visual.", "mtp.")


def qwen3_5_text_tensors(tensors):
    """The text model's tensors under Qwen3_5MoeForCausalLM's names: the multimodal wrapper's
    "model.language_model." prefix becomes "model."; vision and MTP tensors are dropped."""
    out = {}
    for name, x in tensors.items():
        if name.startswith(QWEN3_5_IGNORED_PREFIXES):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        out[name] = x
    return out


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
    if tensors is None:
        tensors = read_checkpoint(folder)
    if is_qwen3_5_moe(cfg):
        model = Qwen3_5MoeForCausalLM(cfg)
        tensors = qwen3_5_text_tensors(tensors)
    else:
        model = MoeForCausalLM(cfg)
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
