"""MXFP4 dequantization (export/mxfp4.py): blocks and scales built by hand give the values the format
defines (tests/hf/test_hf_moe.py compares random ones with transformers' own converter)."""

from __future__ import annotations

import pytest
import torch

from export.mxfp4 import dequantize_mxfp4


def test_hand_built_blocks() -> None:
    """Two blocks of one row: codes 0..15 in order (low nibble first), then all -6, at scales 2^1 and 2^-3."""
    first = [lo | (lo + 1) << 4 for lo in range(0, 16, 2)] * 2  # bytes 0x10, 0x32, ..., 0xFE, twice
    second = [0xFF] * 16
    blocks = torch.tensor([[first, second]], dtype=torch.uint8)  # [1, 2, 16]
    scales = torch.tensor([[127 + 1, 127 - 3]], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, scales)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    expected = [2.0 * v for v in e2m1 * 2] + [-6.0 / 8] * 32
    assert values.shape == (1, 64) and values.dtype == torch.float32
    assert values[0].tolist() == expected
    assert torch.signbit(values[0, 8]) and not torch.signbit(values[0, 0])  # -0.0 stays negative zero


def test_misshaped_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"do not fit"):
        dequantize_mxfp4(torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
