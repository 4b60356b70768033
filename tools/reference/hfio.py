"""Small file-format helpers shared by the reference scripts: safetensors writing, bf16 and
float8_e4m3fn encoding, 128x128 block quantization.

They are written against the published formats with numpy alone (no safetensors or transformers
import), so the checkpoint bytes do not depend on which library versions run the scripts, and the
scripts can be dry-run on a machine without transformers. Not thread-safe (module-level cache).
"""
import json
import struct

import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128

_fp8_table = None


def bf16_round(x):
    """Rounds float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).reshape(x.shape)


def bf16_bytes(x):
    """bfloat16 bytes of float32 values that are already bfloat16-exact."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.array_equal(bf16_round(x), x):
        raise ValueError("bf16_bytes: values are not bfloat16-exact")
    return (x.view(np.uint32) >> 16).astype("<u2").tobytes()


def fp8_e4m3fn_values():
    """The 256 float8_e4m3fn code points decoded to float32 (NaN for the two NaN codes)."""
    global _fp8_table
    if _fp8_table is None:
        codes = np.arange(256, dtype=np.uint32)
        sign = np.where(codes & 0x80, -1.0, 1.0)
        exp = (codes >> 3) & 0xF
        man = (codes & 0x7).astype(np.float64)
        val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
        val = np.where((exp == 15) & ((codes & 7) == 7), np.nan, val)
        _fp8_table = (sign * val).astype(np.float32)
    return _fp8_table


def fp8_e4m3fn_encode(x):
    """Nearest float8_e4m3fn code (ties to the even code) of each value; |x| must be <= 448."""
    x = np.asarray(x, dtype=np.float32)
    if np.any(~np.isfinite(x)) or np.any(np.abs(x) > FP8_MAX):
        raise ValueError("fp8_e4m3fn_encode: value outside the finite fp8 range")
    table = fp8_e4m3fn_values()
    pos_codes = np.arange(0, 127, dtype=np.uint8)  # 0x00..0x7E: +0 .. +448, increasing
    pos_vals = table[pos_codes]
    mag = np.abs(x).ravel()
    hi = np.clip(np.searchsorted(pos_vals, mag, side="left"), 1, len(pos_vals) - 1)
    lo = hi - 1
    d_lo = mag - pos_vals[lo]
    d_hi = pos_vals[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (pos_codes[hi] % 2 == 0))
    code = np.where(pick_hi, pos_codes[hi], pos_codes[lo]).astype(np.uint8)
    code = np.where(x.ravel() < 0, code | 0x80, code).astype(np.uint8)
    return code.reshape(x.shape)


def fp8_block_quantize(w):
    """Quantizes a float32 matrix [rows, cols] to float8_e4m3fn codes with one scale per 128x128
    block (the DeepSeek-V3 / Qwen3-FP8 layout): real = fp8 * scale_inv.

    scale_inv is bfloat16-exact (held in float32), so fp8 * scale_inv is exact in float32.
    Returns (codes uint8 [rows, cols], scale_inv float32 [ceil(rows/128), ceil(cols/128)],
    dequantized float32 [rows, cols]).
    """
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((br, bc), dtype=np.float32)
    deq = np.zeros((rows, cols), dtype=np.float32)
    table = fp8_e4m3fn_values()
    for i in range(br):
        for j in range(bc):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            amax = float(np.max(np.abs(blk)))
            s = bf16_round(np.float32(max(amax, 1e-12) / FP8_MAX)).item()
            q = fp8_e4m3fn_encode(np.clip(blk / np.float32(s), -FP8_MAX, FP8_MAX))
            codes[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = q
            deq[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = table[q] * np.float32(s)
            scales[i, j] = s
    return codes, scales, deq


class Tensor:
    """One tensor to write: safetensors dtype name, shape and raw little-endian bytes."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, list(shape), data

    @staticmethod
    def f32(x):
        x = np.ascontiguousarray(x, dtype="<f4")
        return Tensor("F32", x.shape, x.tobytes())

    @staticmethod
    def bf16(x):
        return Tensor("BF16", np.shape(x), bf16_bytes(x))

    @staticmethod
    def fp8(codes):
        return Tensor("F8_E4M3", codes.shape, np.ascontiguousarray(codes, dtype=np.uint8).tobytes())


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: Tensor} as one safetensors file (8-byte little-endian header length, JSON
    header padded with spaces to 8 bytes, then the data in name order)."""
    header = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(tensors[name].data)


def write_checkpoint(folder, tensors, shards=1):
    """Writes model.safetensors, or `shards` files plus model.safetensors.index.json (the layout
    save_pretrained(max_shard_size=...) produces), cutting in name order by size."""
    import os
    if shards == 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
        return
    names = sorted(tensors)
    total = sum(len(tensors[n].data) for n in names)
    groups, cur, cur_size = [], [], 0
    for n in names:
        if cur and cur_size >= total / shards and len(groups) < shards - 1:
            groups.append(cur)
            cur, cur_size = [], 0
        cur.append(n)
        cur_size += len(tensors[n].data)
    groups.append(cur)
    if len(groups) != shards:
        raise ValueError(f"could not cut {len(names)} tensors into {shards} shards")
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(folder, fname), {n: tensors[n] for n in group})
        for n in group:
            weight_map[n] = fname
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
