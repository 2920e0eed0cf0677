"""Weights that stay in ggml's block formats: :class:`QuantizedTensor` and the decoding of each block type.

A GGUF file (the format of llama.cpp, stable-diffusion.cpp and city96's ComfyUI-GGUF) stores most large weights in
ggml's quantised block formats: a tensor's values, in row-major order (PyTorch's), are cut into blocks of 32 or 256
values, and each block is a fixed number of bytes holding small integers and one or more fp16 scales. A
:class:`QuantizedTensor` keeps those bytes as they are (a ``uint8`` tensor, which may view a memory-mapped file),
with the ggml type and the tensor's logical shape in PyTorch's order (``(out_features, in_features)`` for a Linear
weight), and turns them into floats only when asked (:meth:`QuantizedTensor.dequantize`: one pass in C over the blocks
where :mod:`sdlite.kernels.dequant` runs, else the PyTorch decoders below, vectorised over chunks of blocks; the same
bits either way).

The block layouts are ggml's (``ggml-common.h``; ``QK_K`` = 256 values in the "K" super-blocks). Every decoder
computes in float32 in the same order of operations as ggml's reference ``dequantize_row_*`` functions, so the
result in float32 is the one ggml (and the ``gguf`` package's numpy reference) gives; another dtype is that result
rounded once.

==========  ======  =====  ==================================================================================
type        values  bytes  one block
==========  ======  =====  ==================================================================================
F32/F16/BF16   1    4/2/2  the value itself
Q4_0         32     18     fp16 d; 16 bytes of 4-bit q (low nibbles: values 0-15, high: 16-31); x = (q - 8) d
Q4_1         32     20     fp16 d, fp16 m; 16 bytes of 4-bit q as Q4_0; x = q d + m
Q5_0         32     22     fp16 d; 32 high bits (bit i for value i); 16 bytes of low nibbles as Q4_0; x = (q - 16) d
Q5_1         32     24     fp16 d, fp16 m; high bits and low nibbles as Q5_0; x = q d + m
Q8_0         32     34     fp16 d; 32 int8 q; x = q d
Q2_K        256     84     16 bytes of 4-bit scale | 4-bit min per 16 values; 64 bytes of 2-bit q; fp16 d, fp16 dmin;
                           x = d sc q - dmin m
Q3_K        256    110     32 bytes of high bits; 64 bytes of 2-bit low q; 12 bytes of 16 6-bit scales; fp16 d;
                           x = d (sc - 32) (q - 4 when the high bit is clear)
Q4_K        256    144     fp16 d, fp16 dmin; 12 bytes of 8 6-bit scales and 8 6-bit mins (per 32 values);
                           128 bytes of 4-bit q; x = d sc q - dmin m
Q5_K        256    176     as Q4_K, with 32 bytes of high bits before the nibbles
Q6_K        256    210     128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, fp16 d;
                           x = d sc (q - 32)
==========  ======  =====  ==================================================================================

Types of sdlite's own, in the same form, for weights quantised at load from a dense file (the ``int8`` and ``int4``
precisions of a transformer, and ComfyUI's fp8 ``weight_dtype``: :mod:`sdlite.engine.lowbit`; never read from or
written to a file, so they have no GGUF number):

==========  ========  =========  ==============================================================================
type        values    bytes      one block
==========  ========  =========  ==============================================================================
I8_ROW      one row   4 + row    fp32 d; the row's int8 q (-127..127); x = q d: symmetric, one scale per output
                                 channel (:func:`quantize_int8_rows`)
I4_G64      64        36         fp16 d, fp16 m; 32 bytes of 4-bit q as Q4_0's (low nibbles: values 0-31, high:
                                 32-63); x = q d + m (:func:`quantize_int4_groups`; Q4_1's arithmetic over 64 values)
F8_E4M3     1         1          the value as torch's ``float8_e4m3fn`` (4 exponent bits, 3 mantissa, up to 448)
F8_E5M2     1         1          the value as ``float8_e5m2`` (5 exponent bits, 2 mantissa, up to 57344)
==========  ========  =========  ==============================================================================

The fp8 types are plain values (:func:`cast_fp8`: torch's cast, round to nearest); they convert to bf16, fp16 and fp32
exactly.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..errors import CheckpointError
from ..kernels import dequant

__all__ = ["QuantizedTensor", "QuantizedTensorError", "GGMLType", "GGML_TYPES", "ggml_type", "SUPPORTED_TYPES",
           "int8_rows_type", "int4_groups_type", "quantize_int8_rows", "quantize_int4_groups", "INT4_GROUP",
           "FP8_TYPES", "cast_fp8"]


#: values decoded per step of :meth:`QuantizedTensor.dequantize`. Decoding a whole 12288 x 3072 weight at once
#: allocates (and page-faults) several 150 MB float32 temporaries; in chunks they are reused and stay in cache. On a
#: 2-core Xeon beside a test run, Q8_0 / Q4_K of that weight to bf16 took 0.25 / 0.40 s at once, 0.09 / 0.24 s in
#: chunks of 2**20 values and 0.08 / 0.19 s in chunks of 2**17; but chunks that small run so many short
#: multi-threaded ops that they stalled for seconds when the test run took both cores, where 2**20 stays near the
#: at-once time.
CHUNK_VALUES = 1 << 20


class QuantizedTensorError(CheckpointError, ValueError):
    """A quantised tensor that cannot be built or split as asked; the message names the type, shape and split."""


Decoder = Callable[[torch.Tensor], torch.Tensor]  # (blocks, type_size) uint8 -> (blocks, block_size) float32


class GGMLType(NamedTuple):
    """One ggml tensor type: its name and number in GGUF files, its block of values and bytes, and its decoder
    (``None`` for types sdlite does not read)."""

    name: str
    code: int
    block_size: int
    type_size: int
    decode: Decoder | None = None
    plain: torch.dtype | None = None  # the torch dtype of an unquantised type


# --- reading fields of a block ----------------------------------------------------------------------------------

def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 number at byte ``at`` of every block, as float32, shaped (blocks, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _split_bits(packed: torch.Tensor, shifts: Iterable[int], mask: int) -> torch.Tensor:
    """``(packed >> s) & mask`` for each shift ``s``, stacked before the last dimension:
    (..., n) uint8 -> (..., len(shifts), n)."""
    s = torch.tensor(list(shifts), dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> s) & mask


def _low_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(blocks, 16) bytes -> (blocks, 32) values: the low nibbles are values 0-15, the high ones 16-31."""
    return _split_bits(packed, (0, 4), 0x0F).flatten(1)


def _bit_per_value(packed: torch.Tensor) -> torch.Tensor:
    """(blocks, 4) bytes -> (blocks, 32) bits: bit ``i`` (byte i // 8, bit i % 8) belongs to value ``i``."""
    return _split_bits(packed, range(8), 1).transpose(-1, -2).flatten(1)


# --- the 32-value types -----------------------------------------------------------------------------------------

def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _low_high_nibbles(b[:, 2:18]).float()
    return (q - 8) * _half(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _low_high_nibbles(b[:, 4:20]).float()
    return q * _half(b, 0) + _half(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_low_high_nibbles(b[:, 6:22]) | (_bit_per_value(b[:, 2:6]) << 4)).float()
    return (q - 16) * _half(b, 0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_low_high_nibbles(b[:, 8:24]) | (_bit_per_value(b[:, 4:8]) << 4)).float()
    return q * _half(b, 0) + _half(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].view(torch.int8) * _half(b, 0)  # int8 x float32 -> float32, exact products


# --- the 256-value "K" types ------------------------------------------------------------------------------------

def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 scales and 8 mins of 6 bits, as float32 (blocks, 8, 1).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits
    from the nibbles of bytes 8-11 and their high 2 bits from the top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)


def _nibbles_per_32(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 128 bytes -> (blocks, 8, 32): each run of 32 bytes gives 32 values from its low nibbles, then 32
    from its high ones."""
    return _split_bits(packed.reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[:, 0:16]
    # each half (128 values) reads its 32 bytes four times, two bits at a time
    q = _split_bits(b[:, 16:80].reshape(-1, 2, 32), (0, 2, 4, 6), 0x03).reshape(-1, 16, 16).float()
    dl = _half(b, 80).unsqueeze(-1) * (scales & 0x0F).float().unsqueeze(-1)
    ml = _half(b, 82).unsqueeze(-1) * (scales >> 4).float().unsqueeze(-1)
    return (dl * q - ml).flatten(1)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K: 12 bytes -> 16 scales of 6 bits, as float32 minus 32, shaped (blocks, 16, 1).

    Scale ``s`` (group ``g = s // 4``, ``i = s % 4``) has its low 4 bits in byte ``(g % 2) * 4 + i`` (the low nibble
    for ``g < 2``, the high one after) and its high 2 bits in byte ``8 + i`` at bit ``2 g``.
    """
    low = _split_bits(packed[:, 0:8], (0, 4), 0x0F).flatten(1)
    high = _split_bits(packed[:, 8:12], (0, 2, 4, 6), 0x03).flatten(1)
    return ((low | (high << 4)).float() - 32).unsqueeze(-1)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    low = _split_bits(b[:, 32:96].reshape(-1, 2, 32), (0, 2, 4, 6), 0x03)          # (blocks, 2, 4, 32)
    high = _split_bits(b[:, 0:32], range(8), 0x01).reshape(-1, 2, 4, 32)           # bit 4 h + j
    q = low.float() - 4 * (1 - high).float()
    dl = _half(b, 108).unsqueeze(-1) * _q3_k_scales(b[:, 96:108])
    return (dl * q.reshape(-1, 16, 16)).flatten(1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, m = _k_scales_mins(b[:, 4:16])
    q = _nibbles_per_32(b[:, 16:144]).float()
    return (_half(b, 0).unsqueeze(-1) * sc * q - _half(b, 2).unsqueeze(-1) * m).flatten(1)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, m = _k_scales_mins(b[:, 4:16])
    high = _split_bits(b[:, 16:48], range(8), 0x01)  # (blocks, 8, 32): bit j of byte l for value 32 j + l
    q = (_nibbles_per_32(b[:, 48:176]) | (high << 4)).float()
    return (_half(b, 0).unsqueeze(-1) * sc * q - _half(b, 2).unsqueeze(-1) * m).flatten(1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # each half (128 values) has 64 bytes of nibbles: value 32 k + l (k = 0..3) takes byte (k % 2) 32 + l's low
    # nibble for k < 2, its high one after; and 32 bytes of 2-bit high parts, value 32 k + l at bits 2 k of byte l
    low = _split_bits(b[:, 0:128].reshape(-1, 2, 64), (0, 4), 0x0F).reshape(-1, 2, 4, 32)
    high = _split_bits(b[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 0x03)
    q = (low | (high << 4)).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float().unsqueeze(-1)
    return (_half(b, 208).unsqueeze(-1) * scales * q.reshape(-1, 16, 16)).flatten(1)


def _plain(dtype: torch.dtype) -> Decoder:
    def decode(b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(dtype).float()
    return decode


#: every ggml type by name, as GGUF numbers them (block sizes from ggml's type traits); the readable ones have a
#: decoder
GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in [
    GGMLType("F32", 0, 1, 4, _plain(torch.float32), torch.float32),
    GGMLType("F16", 1, 1, 2, _plain(torch.float16), torch.float16),
    GGMLType("Q4_0", 2, 32, 18, _q4_0),
    GGMLType("Q4_1", 3, 32, 20, _q4_1),
    GGMLType("Q5_0", 6, 32, 22, _q5_0),
    GGMLType("Q5_1", 7, 32, 24, _q5_1),
    GGMLType("Q8_0", 8, 32, 34, _q8_0),
    GGMLType("Q2_K", 10, 256, 84, _q2_k),
    GGMLType("Q3_K", 11, 256, 110, _q3_k),
    GGMLType("Q4_K", 12, 256, 144, _q4_k),
    GGMLType("Q5_K", 13, 256, 176, _q5_k),
    GGMLType("Q6_K", 14, 256, 210, _q6_k),
    GGMLType("Q8_K", 15, 256, 292),
    GGMLType("IQ2_XXS", 16, 256, 66),
    GGMLType("IQ2_XS", 17, 256, 74),
    GGMLType("IQ3_XXS", 18, 256, 98),
    GGMLType("IQ1_S", 19, 256, 50),
    GGMLType("IQ4_NL", 20, 32, 18),
    GGMLType("IQ3_S", 21, 256, 110),
    GGMLType("IQ2_S", 22, 256, 82),
    GGMLType("IQ4_XS", 23, 256, 136),
    GGMLType("I8", 24, 1, 1, None, torch.int8),
    GGMLType("I16", 25, 1, 2, None, torch.int16),
    GGMLType("I32", 26, 1, 4, None, torch.int32),
    GGMLType("I64", 27, 1, 8, None, torch.int64),
    GGMLType("F64", 28, 1, 8, None, torch.float64),
    GGMLType("IQ1_M", 29, 256, 56),
    GGMLType("BF16", 30, 1, 2, _plain(torch.bfloat16), torch.bfloat16),
    GGMLType("TQ1_0", 34, 256, 54),
    GGMLType("TQ2_0", 35, 256, 66),
    GGMLType("MXFP4", 39, 32, 17),
]}
_BY_CODE = {t.code: t for t in GGML_TYPES.values()}

#: the types a QuantizedTensor decodes
SUPPORTED_TYPES: tuple[str, ...] = tuple(name for name, t in GGML_TYPES.items() if t.decode is not None)


# --- sdlite's own types: weights quantised at load ---------------------------------------------------------------

#: values per group of the int4 type: 4.5 bits a value (as Q4_K), where 32 costs 5 (Q4_1) and 128 gives 4.25. The
#: weight's relative error (asymmetric, fp16 d and m) on Gaussian / Laplace / Student-t(3) rows of 3072: 7.8 / 9.2 /
#: 10.0 % in groups of 32, 9.0 / 11.1 / 13.0 % in 64, 10.0 / 13.0 / 16.7 % in 128 (symmetric 64: 10.8 / 14.1 / 18.0 %);
#: every width of FLUX, SD3(.5) and T5-XXL is a multiple of 64
INT4_GROUP = 64


# (each in two vectorised same-dtype passes over the chunk: a mixed int8 x float32 product, or _split_bits'
# broadcast shifts, ran 1.5x / 4.6x slower, 0.11 s against 0.07 s and 0.51 s against 0.11 s for a 12288 x 3072 weight
# on one thread)
def _int8_row(b: torch.Tensor) -> torch.Tensor:
    return b[:, 4:].view(torch.int8).float().mul_(b[:, 0:4].contiguous().view(torch.float32))


def _int4_group(b: torch.Tensor) -> torch.Tensor:
    nibbles = b[:, 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float()
    return q.mul_(_half(b, 0)).add_(_half(b, 2))


def int8_rows_type(row: int) -> GGMLType:
    """I8_ROW for rows of ``row`` values: a block is one row (an fp32 scale, then the row's int8 values)."""
    return GGMLType("I8_ROW", -1, int(row), 4 + int(row), _int8_row)


def int4_groups_type(group: int = INT4_GROUP) -> GGMLType:
    """I4_G``group``: blocks of ``group`` (even) values, an fp16 scale and minimum, then the 4-bit values."""
    if group < 2 or group % 2:
        raise QuantizedTensorError(f"an int4 group holds an even number of values, not {group}")
    return GGMLType(f"I4_G{group}", -1, int(group), 4 + group // 2, _int4_group)


def _dense_2d(w: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.is_floating_point():
        raise QuantizedTensorError(f"{what} quantises a 2-D floating-point weight (out_features, in_features), got "
                                   f"{getattr(w, 'dtype', type(w).__name__)} of shape {list(getattr(w, 'shape', []))}")
    return w


#: output rows quantised at a time (the float32 temporaries of a 12288 x 3072 weight stay ~25 MB)
_ROWS_AT_ONCE = 2048


def quantize_int8_rows(w: torch.Tensor) -> QuantizedTensor:
    """``w`` (out, in) as I8_ROW: each row scaled by ``max |w| / 127`` (an all-zero row by 1) and rounded to the
    nearest int8; the products ``q d`` are those values' best symmetric 8-bit approximation."""
    w = _dense_2d(w, "int8")
    rows, cols = w.shape
    out = torch.empty(rows, 4 + cols, dtype=torch.uint8, device=w.device)
    for start in range(0, rows, _ROWS_AT_ONCE):
        part = w[start:start + _ROWS_AT_ONCE].to(torch.float32, copy=True)
        d = part.abs().amax(dim=1, keepdim=True) / 127
        d = torch.where(d > 0, d, torch.ones_like(d))
        out[start:start + _ROWS_AT_ONCE, 0:4] = d.view(torch.uint8)
        out[start:start + _ROWS_AT_ONCE, 4:] = part.div_(d).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return QuantizedTensor(out.view(-1), int8_rows_type(cols), (rows, cols))


def quantize_int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> QuantizedTensor:
    """``w`` (out, in; ``in`` a multiple of ``group``) as I4_G``group``: each group's values mapped onto 0..15
    between its minimum ``m`` and maximum (``d = (max - min) / 15``, both rounded to fp16 first, so the values are
    rounded against the scale and offset the decoder reads); a constant group decodes to its value rounded to fp16.
    Values beyond fp16's range (65504) are refused."""
    w = _dense_2d(w, "int4")
    kind = int4_groups_type(group)
    rows, cols = w.shape
    if cols % group:
        raise QuantizedTensorError(f"int4 in groups of {group} needs rows whose length is a multiple of {group}; "
                                   f"this weight has {cols} columns")
    per_row = cols // group
    out = torch.empty(rows, per_row, kind.type_size, dtype=torch.uint8, device=w.device)
    for start in range(0, rows, _ROWS_AT_ONCE):
        part = w[start:start + _ROWS_AT_ONCE].to(torch.float32, copy=True).view(-1, per_row, group)
        low, high = part.amin(dim=-1, keepdim=True), part.amax(dim=-1, keepdim=True)
        m = low.half()
        d = ((high - m.float()) / 15).half()
        if not (torch.isfinite(m).all() and torch.isfinite(d).all()):
            raise QuantizedTensorError(f"int4 keeps fp16 scales: this weight's values reach "
                                       f"{part.abs().max().item():g}, beyond fp16's 65504")
        d = torch.where(d.float() > 0, d, torch.ones_like(d))
        q = part.sub_(m.float()).div_(d.float()).round_().clamp_(0, 15).to(torch.uint8)
        half = group // 2
        block = out[start:start + _ROWS_AT_ONCE]
        block[..., 0:2] = d.view(torch.uint8)
        block[..., 2:4] = m.view(torch.uint8)
        block[..., 4:] = q[..., :half] | (q[..., half:] << 4)
    return QuantizedTensor(out.view(-1), kind, (rows, cols))


#: the fp8 types by torch dtype: one byte a value, the bytes are the value
FP8_TYPES: dict[torch.dtype, GGMLType] = {
    dtype: GGMLType(name, -1, 1, 1, _plain(dtype), dtype)
    for name, dtype in (("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2))}


def cast_fp8(w: torch.Tensor, dtype: torch.dtype) -> QuantizedTensor:
    """``w`` (out, in) cast to the fp8 ``dtype`` (a key of :data:`FP8_TYPES`), as ComfyUI stores a model loaded with an
    fp8 ``weight_dtype``: torch's conversion, rounding to the nearest fp8 value. A weight with values beyond the
    type's range (which the conversion would clip to 448 for e4m3fn, or make infinite for e5m2) is refused, naming
    the largest value."""
    w = _dense_2d(w, "fp8")
    if dtype not in FP8_TYPES:
        raise QuantizedTensorError(f"{dtype} is not an fp8 type: expected one of "
                                   f"{', '.join(str(d) for d in FP8_TYPES)}")
    if w.dtype == dtype:   # stored in this fp8 type already (an fp8 file)
        return QuantizedTensor(w.contiguous().view(torch.uint8).reshape(-1).clone(), FP8_TYPES[dtype], w.shape)
    if w.dtype in FP8_TYPES:   # the other fp8 type: exact in bf16
        w = w.to(torch.bfloat16)
    largest = w.abs().amax().item() if w.numel() else 0.0
    if not largest <= torch.finfo(dtype).max:
        raise QuantizedTensorError(f"this weight's values reach {largest:g}, beyond {dtype}'s range "
                                   f"({torch.finfo(dtype).max:g})")
    data = w.to(dtype, copy=True).view(torch.uint8).reshape(-1)
    return QuantizedTensor(data, FP8_TYPES[dtype], w.shape)


def ggml_type(qtype: str | int | GGMLType) -> GGMLType:
    """The ggml type named (``"Q8_0"``) or numbered (8) by ``qtype``; any other is a QuantizedTensorError."""
    if isinstance(qtype, GGMLType):
        return qtype
    found = _BY_CODE.get(int(qtype)) if not isinstance(qtype, str) else GGML_TYPES.get(qtype.upper())
    if found is None:
        raise QuantizedTensorError(f"unknown ggml tensor type {qtype!r}")
    return found


class QuantizedTensor:
    """A tensor kept in a ggml block format: its raw bytes, its ggml type and its logical shape.

    * ``data``: a 1-D ``uint8`` tensor of exactly :attr:`nbytes` bytes (it may view a memory-mapped file; nothing
      here writes to it). The values are in row-major order over ``shape``, cut into blocks of the type.
    * ``shape``: the logical shape in PyTorch's order (``(out_features, in_features)`` for a Linear weight).
    * :meth:`dequantize` gives the floats; :meth:`rows` (and ``qt[start:stop]``) a slice of whole rows along
      dimension 0, still quantised; :meth:`reshape` another logical shape of as many values; :meth:`to` moves the
      bytes to a device.
    """

    __slots__ = ("data", "type", "shape")

    def __init__(self, data: torch.Tensor, qtype: str | int | GGMLType, shape: Iterable[int]):
        t = ggml_type(qtype)
        if t.decode is None:
            readable = ", ".join(SUPPORTED_TYPES)
            raise QuantizedTensorError(f"ggml type {t.name} is not supported (sdlite reads {readable})")
        shape = torch.Size(int(d) for d in shape)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
            raise QuantizedTensorError(f"{t.name} data must be a uint8 tensor of raw bytes, got "
                                       f"{getattr(data, 'dtype', type(data).__name__)}")
        numel = math.prod(shape)
        if numel % t.block_size:
            raise QuantizedTensorError(f"shape {list(shape)} holds {numel} values, not a whole number of {t.name} "
                                       f"blocks of {t.block_size}")
        need = numel // t.block_size * t.type_size
        if data.numel() != need:
            raise QuantizedTensorError(f"{t.name} tensor of shape {list(shape)} needs {need} bytes, got "
                                       f"{data.numel()}")
        self.data = data.reshape(-1)
        self.type = t
        self.shape = shape

    # -- what it is ----------------------------------------------------------------------------------------------

    @property
    def qtype(self) -> str:
        """The ggml type's name, e.g. ``"Q4_K"``."""
        return self.type.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes it holds (its size in memory, and in the file)."""
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def numel(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        bits = 8 * self.nbytes / max(self.numel(), 1)
        return (f"QuantizedTensor({self.qtype}, shape={list(self.shape)}, {self.nbytes} bytes, "
                f"{bits:.3g} bits/value, device={self.device.type})")

    # -- values --------------------------------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as a new dense tensor of ``shape`` in ``dtype`` (computed in float32, rounded once)."""
        t = self.type
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=dtype, device=self.device)
        if t.plain is not None:  # F32/F16/BF16: the bytes are the values
            return self.data.view(t.plain).view(self.shape).to(dtype, copy=True)
        blocks = self.data.view(-1, t.type_size)
        out = torch.empty(blocks.shape[0], t.block_size, dtype=dtype, device=self.device)
        if dequant.decode(t.name, t.block_size, t.type_size, self.data, out):  # one pass in C, the same bits
            return out.view(self.shape)
        step = max(1, CHUNK_VALUES // t.block_size)
        for start in range(0, blocks.shape[0], step):  # a few thousand blocks at a time, each chunk vectorised
            out[start:start + step] = t.decode(blocks[start:start + step])
        return out.view(self.shape)

    # -- quantised views -----------------------------------------------------------------------------------------

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        """Rows ``start`` to ``stop`` (dimension 0, ``stop`` excluded), without dequantising: a view of the same
        bytes. The slice must begin and end on block boundaries (always so when a row holds whole blocks, as a
        quantised Linear weight's does); one that does not is refused, naming it."""
        n = self.shape[0] if self.shape else 0
        if not self.shape or not (0 <= start <= stop <= n):
            raise QuantizedTensorError(f"rows [{start}, {stop}) are not a slice of the {n} rows of "
                                       f"{self.qtype} tensor of shape {list(self.shape)}")
        per_row = math.prod(self.shape[1:])
        first, last = start * per_row, stop * per_row
        block = self.type.block_size
        if first % block or last % block:
            raise QuantizedTensorError(
                f"rows [{start}, {stop}) of {self.qtype} tensor of shape {list(self.shape)} do not fall on block "
                f"boundaries: a row holds {per_row} values and a block {block}, so the split would cut a block")
        size = self.type.type_size
        data = self.data[first // block * size:last // block * size]
        return QuantizedTensor(data, self.type, (stop - start, *self.shape[1:]))

    def __getitem__(self, index) -> QuantizedTensor:
        """``qt[start:stop]``: :meth:`rows` (the only indexing a quantised tensor allows)."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise QuantizedTensorError(f"a {self.qtype} tensor can only be sliced by whole rows "
                                       f"(qt[start:stop]), not indexed by {index!r}")
        start, stop, _ = index.indices(self.shape[0] if self.shape else 0)
        return self.rows(start, max(start, stop))

    def reshape(self, *shape) -> QuantizedTensor:
        """The same bytes under another logical shape of as many values (one ``-1`` may stand for the rest)."""
        if len(shape) == 1 and isinstance(shape[0], Iterable):
            shape = tuple(shape[0])
        shape = list(shape)
        if shape.count(-1) == 1:
            rest = math.prod(d for d in shape if d != -1)
            shape[shape.index(-1)] = self.numel() // rest if rest else 0
        if math.prod(shape) != self.numel():
            raise QuantizedTensorError(f"cannot reshape {self.qtype} tensor of shape {list(self.shape)} "
                                       f"({self.numel()} values) to {list(shape)}")
        return QuantizedTensor(self.data, self.type, shape)

    view = reshape

    def to(self, device) -> QuantizedTensor:
        """The same tensor with its bytes on ``device`` (itself when they are there already). Dtypes are not
        conversions of a quantised tensor: use :meth:`dequantize`."""
        if isinstance(device, torch.dtype):
            raise QuantizedTensorError(f"a {self.qtype} tensor is not converted by .to({device}); use "
                                       f".dequantize({device})")
        data = self.data.to(device)
        return self if data is self.data else QuantizedTensor(data, self.type, self.shape)
