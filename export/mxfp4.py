"""MXFP4 weights (the OCP microscaling format gpt-oss publishes its experts in), read exactly as float32.

A block of 32 weights is 16 bytes of 4-bit E2M1 codes, two a byte (the low nibble first), and one uint8
E8M0 scale: the block's power of two, biased by 127. Weight 2i of a block is E2M1[byte i & 0xF] and weight
2i + 1 is E2M1[byte i >> 4], each times 2^(scale - 127). Every such product is a float32 exactly (an E2M1
value has at most two significant bits), so nothing is rounded. A checkpoint stores a projection's weight
[..., rows, K] as `*_blocks` [..., rows, K / 32, 16] and `*_scales` [..., rows, K / 32].
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # weights per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 scales -> [..., G * 32] float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, found {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: blocks must be "
            f"[..., G, {BLOCK // 2}] over scales [..., G]"
        )
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = table[codes]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].to(torch.float32)).flatten(-2)
