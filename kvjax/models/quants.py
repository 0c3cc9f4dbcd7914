"""llama.cpp's weight types, dequantized to float32 with numpy (docs/gguf.md, "Types").

Each `_<TYPE>` maps a tensor's blocks, uint8 `[n, type_size]`, to float32 `[n, block_size]`,
in the order and with the float operations of llama.cpp's `dequantize_row_<type>`
(ggml-quants.c): a float16 scale widened to float32, multiplied by the integer code, minus
the block's minimum where the type has one. The same operations in the same order give the
same bits as the `gguf` package's `gguf.quants` (tests/test_gguf_quants.py holds every type
to it bit for bit; Q8_K, which `gguf` lacks, to the C loop written out). Blocks are
dequantized in chunks, so a 136M-weight embedding does not hold every intermediate at once.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # the weights of a K-quant super-block


def _f16(b_NB: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 `[n, 1]`."""
    return np.ascontiguousarray(b_NB[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs_NB: np.ndarray) -> np.ndarray:
    """`[n, b]` bytes -> `[n, 2, b]`: the low nibbles, then the high ones."""
    return np.stack([qs_NB & 15, qs_NB >> 4], axis=1)


def _bits(b_NB: np.ndarray, count: int, width: int) -> np.ndarray:
    """`[n, b]` bytes -> `[n, count, b]`: field k is bits [k * width, (k + 1) * width)."""
    shift = (np.arange(count, dtype=np.uint8) * width)[None, :, None]
    return (b_NB[:, None, :] >> shift) & np.uint8((1 << width) - 1)


def _q8_0(b):
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b, 0)


def _q4_0(b):
    q = _nibbles(b[:, 2:]).reshape(len(b), 32).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * _f16(b, 0)


def _q4_1(b):
    q = _nibbles(b[:, 4:]).reshape(len(b), 32).astype(np.float32)
    return q * _f16(b, 0) + _f16(b, 2)


def _q5(b, at: int) -> np.ndarray:
    """The 5-bit codes of a Q5_0 / Q5_1 block: a nibble and bit j of the 32-bit `qh` at
    byte `at` (bit j + 16 for the high nibbles)."""
    qh = np.ascontiguousarray(b[:, at:at + 4]).view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[:, at + 4:]).reshape(len(b), 32) | (high << 4)


def _q5_0(b):
    return (_q5(b, 2).astype(np.int8) - np.int8(16)).astype(np.float32) * _f16(b, 0)


def _q5_1(b):
    return _q5(b, 4).astype(np.float32) * _f16(b, 0) + _f16(b, 2)


def _q8_k(b):
    d = np.ascontiguousarray(b[:, :4]).view(np.float32)
    return d * b[:, 4:4 + QK_K].view(np.int8).astype(np.float32)


def _k4_scales(s_N12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 8 six-bit scales and 8 six-bit minimums packed in 12 bytes
    (`get_scale_min_k4`): the first four of each in bytes 0-3 / 4-7, the last four's low
    nibbles in bytes 8-11 and their top two bits in the top bits of bytes 0-3 / 4-7."""
    lo, mid, hi = s_N12[:, 0:4], s_N12[:, 4:8], s_N12[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _affine_k(b, q_N8S: np.ndarray) -> np.ndarray:
    """d * sc * q - dmin * m per 32-weight sub-block of a Q4_K / Q5_K block."""
    sc, m = _k4_scales(b[:, 4:16])
    d1 = (_f16(b, 0) * sc)[:, :, None]
    m1 = (_f16(b, 2) * m)[:, :, None]
    return (d1 * q_N8S.astype(np.float32) - m1).reshape(len(b), QK_K)


def _q4_k(b):
    # 4 chunks of 32 bytes; each: 32 weights from the low nibbles, then 32 from the high
    return _affine_k(b, _nibbles(b[:, 16:].reshape(-1, 32)).reshape(len(b), 8, 32))


def _q5_k(b):
    n = len(b)
    low = _nibbles(b[:, 48:].reshape(-1, 32)).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], 8, 1)  # sub-block k takes bit k of qh
    return _affine_k(b, low | (high << 4))


def _per16(d_N: np.ndarray, scales_N16: np.ndarray, q_N256: np.ndarray) -> np.ndarray:
    """(d * scale) * q with one scale per 16 weights."""
    dl = (d_N * scales_N16)[:, :, None]
    return (dl * q_N256.reshape(len(q_N256), 16, 16).astype(np.float32)).reshape(-1, QK_K)


def _q2_k(b):
    n = len(b)
    # 2 halves of 32 bytes, each 4 two-bit planes of 32 weights
    q = _bits(b[:, 16:80].reshape(-1, 32), 4, 2).reshape(n, 16, 16).astype(np.float32)
    s = b[:, :16]
    dl = (_f16(b, 80) * (s & 15).astype(np.float32))[:, :, None]
    ml = (_f16(b, 82) * (s >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = len(b)
    low = _bits(b[:, 32:96].reshape(-1, 32), 4, 2).reshape(n, 8, 32).astype(np.int8)
    mask = _bits(b[:, :32], 8, 1).astype(np.int8)  # plane k takes bit k of hmask
    q = low - ((1 - mask) << 2)  # a clear bit subtracts 4
    s = b[:, 96:108]
    # 16 six-bit scales: low nibbles of bytes 0-7 then their high nibbles; the top two bits
    # of scale k are bits 2 * (k // 4) of byte 8 + k % 4
    low4 = np.concatenate([s[:, :8] & 15, s[:, :8] >> 4], axis=1)
    top2 = _bits(s[:, 8:12], 4, 2).reshape(n, 16)
    scales = ((low4 | (top2 << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    return _per16(_f16(b, 108), scales, q)


def _q6_k(b):
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 2, 32)  # [half, first / second 32 bytes, 32]
    # quarter t of a half: the low nibbles of bytes (t % 2), then (t >= 2) their high ones
    low = np.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4],
                   axis=2)
    high = _bits(b[:, 128:192].reshape(-1, 32), 4, 2).reshape(n, 2, 4, 32)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, QK_K)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    return _per16(_f16(b, 208), scales, q)


# type -> (weights a block, bytes a block, dequantize)
BLOCKS = {
    "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q2_K": (QK_K, 84, _q2_k), "Q3_K": (QK_K, 110, _q3_k), "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k), "Q8_K": (QK_K, 292, _q8_k),
}
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": None}
TYPES = (*FLOATS, *BLOCKS)
CHUNK = 1 << 15  # blocks a step: ~32 MB of float32 out for the K-quants


def nbytes(kind: str, count: int) -> int:
    """The bytes of `count` weights of type `kind`."""
    if kind in FLOATS:
        return count * (2 if kind != "F32" else 4)
    size, type_size, _ = BLOCKS[kind]
    return count // size * type_size


def dequantize(raw: np.ndarray, kind: str, count: int) -> np.ndarray:
    """`count` weights of type `kind` (a name of `TYPES`) from their bytes, as float32 1-D."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if kind not in TYPES:
        raise ValueError(f"type {kind} is not supported; supported: {', '.join(TYPES)}")
    if raw.size != nbytes(kind, count):
        raise ValueError(f"{count} weights of type {kind} take {nbytes(kind, count)} bytes, "
                         f"not {raw.size}")
    if kind == "F32":
        return raw.view(np.float32).copy()
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32)
    if kind == "BF16":  # the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    size, type_size, fn = BLOCKS[kind]
    blocks = raw.reshape(-1, type_size)
    out = np.empty((len(blocks), size), np.float32)
    for i in range(0, len(blocks), CHUNK):
        out[i:i + CHUNK] = fn(blocks[i:i + CHUNK])
    return out.reshape(-1)
