"""Gradient compression for the wire: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``.

Same protocol as Horovod's ``horovod.torch.compression``: ``compress(tensor) -> (tensor, ctx)``
before communication, ``decompress(tensor, ctx) -> tensor`` after. Only floating-point tensors
are cast; integer tensors pass through unchanged.

Precision: fp16 keeps 11 significant bits (relative rounding error ≤ 2**-11 ≈ 4.9e-4 per value
and per addition) and overflows above 65504; bf16 keeps 8 bits (≤ 2**-8 ≈ 3.9e-3) with fp32's
range. A sum over N ranks adds at most N-1 further roundings.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface: reduce the bytes a tensor takes on the wire, then restore it."""

    #: dtype on the wire for floating-point tensors, or None for "unchanged".
    wire_dtype: Any = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return ``(compressed, ctx)``; ``ctx`` is handed back to :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor restored to its original dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor goes on the wire as it is."""

    wire_dtype = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return the tensor itself."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor itself."""
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:  # type: ignore[override]
        """Cast a floating-point tensor to the wire dtype; ctx is the original dtype."""
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        """Cast back to the original dtype recorded by :meth:`compress`."""
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Cast floating-point tensors to float16 on the wire (half the bytes of fp32)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Cast floating-point tensors to bfloat16 on the wire (fp32's range, 8 significant bits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compression algorithms, as in Horovod: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
