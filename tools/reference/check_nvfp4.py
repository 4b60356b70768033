#!/usr/bin/env python3
"""Checks the engine on an NVIDIA ModelOpt NVFP4 checkpoint (make_tiny_model --dtype nvfp4, or a
real one) against a reference that shares no code with the engine or the exporter.

Every NVFP4 tensor (U8 `weight` [out, in/2], F8_E4M3 `weight_scale` [out, in/16], F32
`weight_scale_2`) is dequantized with torch's own float types: the packed bytes viewed as
torch.float4_e2m1fn_x2 (element 2i in the low nibble of byte i, 2i+1 in the high one), the scales
viewed as torch.float8_e4m3fn, real = e2m1 * float(weight_scale of its 16-group) * weight_scale_2.
The dequantized model runs in float64 through qwen_torch.py (transformers' modeling written out
in torch), and its teacher-forced logits are compared with the engine's
(`generate --input-ids IDS.npy --dump-logits OURS.npy --expert_format nvfp4`).

The engine's nvfp4 kernels quantize activations to int8 per 32 elements, so the logits agree to
about 1e-2 of the largest logit, not 1e-4; and where the reference's router nearly ties (top-k
gap below --router-margin in any MoE layer) that rounding may pick the other expert, which moves
that position's logits and every later one, so each row is compared up to its first such position
(the rule the fixtures in engine/testdata follow by drawing their prompts again). A negative control runs the same reference with the
up projections dequantized with the gate's per-tensor scale (what an engine keeping one scale per
expert computes); the engine's logits must be closer to the true reference than to that one.

Where torch lacks float4_e2m1fn_x2 / float8_e4m3fn (torch < 2.1, e.g. Debian's 1.13) the
dequantization falls back to a numpy decoder written from the formats' bit layouts, labelled
"numpy fallback" in the output: that run checks the script's plumbing only, not independence.

  python3 tools/reference/check_nvfp4.py --model DIR --input-ids ids.npy --logits ours.npy
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen_torch  # noqa: E402


def read_raw(folder):
    """{name: (dtype, shape, bytes)} of every tensor of a model folder."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fname in files:
        with open(os.path.join(folder, fname), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        for name, h in header.items():
            if name == "__metadata__":
                continue
            a, b = h["data_offsets"]
            out[name] = (h["dtype"], list(h["shape"]), data[a:b])
    return out


def to_float(dtype, shape, raw):
    if dtype == "BF16":
        x = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype == "F32":
        x = np.frombuffer(raw, dtype="<f4")
    elif dtype == "F16":
        x = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    else:
        raise ValueError(f"dtype {dtype} is not a float dtype")
    return x.astype(np.float64).reshape(shape)


def torch_has_fp4():
    return hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "float8_e4m3fn")


def e2m1_torch(packed):
    """[rows, cols/2] uint8 -> [rows, cols] float64 through torch.float4_e2m1fn_x2."""
    t = torch.from_numpy(packed.copy())
    fp4 = t.view(torch.float4_e2m1fn_x2)
    try:
        # torch unpacks x2 into its two elements (low nibble first) when converting.
        vals = fp4.to(torch.float32)
        if vals.shape[-1] == packed.shape[-1]:
            raise RuntimeError("conversion did not unpack the pairs")
    except (RuntimeError, TypeError, NotImplementedError):
        # Conversion not implemented for the x2 dtype: each nibble widened into torch's
        # float8_e4m3fn (exactly representable: e2m1 is a subset of e4m3), decoded by torch.
        lo = (t & 0xF).to(torch.int32)
        hi = (t >> 4).to(torch.int32)
        nib = torch.stack([lo, hi], dim=-1).reshape(t.shape[0], -1)
        sign = (nib >> 3) & 1
        e = (nib >> 1) & 3
        m = nib & 1
        # e2m1 normal (e > 0): 2^(e-1) * (1 + m/2) = e4m3 exponent e + 6, mantissa m << 2;
        # subnormal (e == 0): m * 0.5 = e4m3 exponent 6, mantissa 0 (or zero).
        e4 = torch.where(e > 0, e + 6, torch.where(m > 0, torch.full_like(e, 6), torch.zeros_like(e)))
        m4 = torch.where(e > 0, m << 2, torch.zeros_like(m))
        bits = ((sign << 7) | (e4 << 3) | m4).to(torch.uint8)
        return bits.view(torch.float8_e4m3fn).to(torch.float64).numpy()
    return vals.to(torch.float64).reshape(packed.shape[0], -1).numpy()


def e4m3_torch(codes):
    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()


def e2m1_numpy(packed):
    """Plumbing fallback: e2m1 from its bit layout (sign bit 3, exponent bits 2..1 bias 1)."""
    nib = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    e = (nib >> 1) & 3
    m = (nib & 1).astype(np.float64)
    v = np.where(e == 0, 0.5 * m, np.ldexp(1.0 + 0.5 * m, e.astype(np.int64) - 1))
    return np.where(nib & 8, -v, v)


def e4m3_numpy(codes):
    e = ((codes >> 3) & 15).astype(np.int64)
    m = (codes & 7).astype(np.float64)
    v = np.where(e == 0, np.ldexp(m / 8.0, -6), np.ldexp(1.0 + m / 8.0, e - 7))
    return np.where(codes & 0x80, -v, v)


def dequantize(raw, use_torch, one_scale=False):
    """{name: float64 array}: NVFP4 weights dequantized, scale tensors dropped. one_scale:
    up_proj weights use their gate_proj's weight_scale_2 (the negative control)."""
    out, count = {}, 0
    e2m1, e4m3 = (e2m1_torch, e4m3_torch) if use_torch else (e2m1_numpy, e4m3_numpy)
    for name, (dtype, shape, data) in raw.items():
        base = name[: -len("_scale_2")] if name.endswith("_scale_2") else name[: -len("_scale")]
        if name.endswith(("_scale", "_scale_2")) and raw.get(base, ("",))[0] == "U8":
            continue  # read with its weight
        if name.endswith(".input_scale"):
            continue  # the activation scale: not needed for weight-only use
        if dtype != "U8":
            out[name] = to_float(dtype, shape, data)
            continue
        if name + "_scale" not in raw or name + "_scale_2" not in raw:
            raise ValueError(f"U8 tensor {name} without {name}_scale / {name}_scale_2")
        rows, half = shape
        packed = np.frombuffer(data, dtype=np.uint8).reshape(rows, half)
        sd, sshape, sraw = raw[name + "_scale"]
        if sd != "F8_E4M3" or sshape != [rows, 2 * half // 16]:
            raise ValueError(f"{name}_scale: {sd} {sshape}, expected F8_E4M3 {[rows, 2 * half // 16]}")
        scales = e4m3(np.frombuffer(sraw, dtype=np.uint8).reshape(sshape))
        gname = name + "_scale_2"
        if one_scale and name.endswith("up_proj.weight"):
            gname = name.replace("up_proj.weight", "gate_proj.weight") + "_scale_2"
        gd, _, graw = raw[gname]
        assert gd == "F32", gname
        glob = float(np.frombuffer(graw, dtype="<f4")[0])
        out[name] = e2m1(packed) * np.repeat(scales, 16, axis=1) * glob
        count += 1
    return out, count


def fuse_qwen3_5_experts(tensors, cfg):
    """qwen_torch's Qwen3_5MoeExperts takes fused gate_up_proj / down_proj; NVFP4 releases store
    experts one by one. Stack them (gate rows, then up rows, per expert)."""
    text = qwen_torch.text_config(cfg)
    E = text["num_experts"]
    prefixes = sorted({n.split(".experts.")[0] for n in tensors if ".mlp.experts.0.gate_proj.weight" in n})
    for p in prefixes:
        gu, dn = [], []
        for e in range(E):
            q = f"{p}.experts.{e}."
            gu.append(np.concatenate([tensors.pop(q + "gate_proj.weight"), tensors.pop(q + "up_proj.weight")]))
            dn.append(tensors.pop(q + "down_proj.weight"))
        tensors[p + ".experts.gate_up_proj"] = np.stack(gu)
        tensors[p + ".experts.down_proj"] = np.stack(dn)
    return tensors


def reference_logits(folder, cfg, tensors, ids):
    """Logits [B, T, V] and, per (row, position), the smallest gap in router logits between the
    k-th and (k+1)-th expert over the MoE layers [B, T]."""
    if qwen_torch.is_qwen3_5_moe(cfg):
        tensors = fuse_qwen3_5_experts(tensors, cfg)
    model = qwen_torch.load_model(folder, torch.float64, tensors=tensors)
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)))
    logits, routers = out if isinstance(out, tuple) else (out, [])
    k = qwen_torch.text_config(cfg)["num_experts_per_tok"]
    gap = np.full(ids.shape, np.inf)
    for r in routers:
        top = r.sort(dim=-1, descending=True).values.numpy()
        gap = np.minimum(gap, (top[:, k - 1] - top[:, k]).reshape(ids.shape))
    return logits.numpy(), gap


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the NVFP4 model folder")
    ap.add_argument("--input-ids", required=True, help=".npy int [batch, tokens] (or [tokens])")
    ap.add_argument("--logits", required=True, help="the engine's --dump-logits output")
    ap.add_argument("--tol", type=float, default=0.05, help="max |logit diff| / max |logit|")
    ap.add_argument("--router-margin", type=float, default=0.02,
                    help="compare each row up to its first position whose router has a top-k gap "
                         "below this (in logits) in any MoE layer")
    ap.add_argument("--min-positions", type=int, default=8,
                    help="fail when a row has fewer positions before its first near-tie")
    ap.add_argument("--allow-numpy", action="store_true",
                    help="run with the numpy fallback where torch lacks float4/float8 (plumbing only)")
    args = ap.parse_args()

    use_torch = torch_has_fp4()
    if use_torch:
        print(f"torch {torch.__version__}: dequantizing with torch.float4_e2m1fn_x2 and torch.float8_e4m3fn")
    elif args.allow_numpy:
        print(f"torch {torch.__version__} lacks float4_e2m1fn_x2/float8_e4m3fn: numpy fallback "
              "dequantizer (PLUMBING CHECK ONLY, not an independent reference)")
    else:
        sys.exit(f"torch {torch.__version__} lacks float4_e2m1fn_x2/float8_e4m3fn; run on the GPU "
                 "machine's torch, or pass --allow-numpy for a plumbing check")

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    ids = np.load(args.input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    got = np.load(args.logits).astype(np.float64)
    if got.ndim == 2:
        got = got[None]
    raw = read_raw(args.model)
    tensors, n = dequantize(raw, use_torch)
    print(f"{args.model}: {n} NVFP4 tensors dequantized")
    want, gap = reference_logits(args.model, cfg, tensors, ids)
    control, _ = dequantize(raw, use_torch, one_scale=True)
    wrong, _ = reference_logits(args.model, cfg, control, ids)
    if got.shape != want.shape:
        sys.exit(f"shapes differ: engine {got.shape}, reference {want.shape}")
    worst, ok = 0.0, True
    for b in range(ids.shape[0]):
        # The engine's experts see int8-quantized activations: where the reference's router
        # nearly ties, that rounding may legitimately pick the other expert, which moves that
        # position's logits and, through the KV cache and recurrent state, every later one. Each
        # row is compared up to its first such position (the fixtures' rule, per position).
        ties = np.nonzero(gap[b] < args.router_margin)[0]
        n = int(ties[0]) if len(ties) else ids.shape[1]
        if n < args.min_positions:
            ok = False
            print(f"row {b}: router near-tie at position {n} (gap {gap[b][n]:.3g}): fewer than "
                  f"{args.min_positions} positions to compare; draw other ids")
            continue
        scale = float(np.max(np.abs(want[b, :n])))
        ratio = float(np.max(np.abs(got[b, :n] - want[b, :n]))) / max(scale, 1e-30)
        ratio_wrong = float(np.max(np.abs(got[b, :n] - wrong[b, :n]))) / max(scale, 1e-30)
        agree = float(np.mean(got[b, :n].argmax(-1) == want[b, :n].argmax(-1)))
        worst = max(worst, ratio)
        closer = ratio < ratio_wrong
        ok = ok and closer
        tie = (f"positions 0-{n - 1} (router near-tie at {n}, gap {gap[b][n]:.3g} < "
               f"{args.router_margin})" if n < ids.shape[1] else f"all {n} positions")
        print(f"row {b}, {tie}: max |diff| / max |logit| = {ratio:.3g} (one-scale control "
              f"{ratio_wrong:.3g}, "
              f"{'closer to the true reference' if closer else 'NOT closer than the control'}), "
              f"argmax agrees on {agree:.1%}")
    ok = ok and worst <= args.tol
    print(f"{'PASS' if ok else 'FAIL'}: worst ratio {worst:.3g}, tolerance {args.tol}"
          + ("" if use_torch else " (numpy fallback: plumbing only)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
