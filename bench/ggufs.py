"""GGUF files of random weights at real shapes, for the benchmarks (bench/flux.py, bench/edit.py, bench/zimage.py,
bench/klein.py): written tensor by tensor, so a file of many GB is never held in memory whole.

The gguf package quantises to Q8_0 in numpy but not to the k-quants (``gguf.quants.quantize`` raises
NotImplementedError for Q4_K), so a quantised tensor here is a block of random codes with the format's layout and
scales of a realistic size, not a quantisation of some float weight: the same shapes and bytes a published file has,
other values.

* ``Q8_0`` (32 values, 34 bytes): an fp16 scale ``d`` of about 0.02 * 3 / 127 (values of about a ``randn * 0.02``
  weight's size), then 32 int8 codes in -127..127.
* ``Q4_K`` (256 values, 144 bytes): fp16 ``d`` and ``dmin`` of about 6e-5, 12 bytes of 6-bit scales and mins, 128 bytes
  of nibbles, all random.

Each quantised tensor's codes come from a generator seeded by its name: the same file whenever it is written.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np

BLOCKS = {"Q8_0": (32, 34), "Q4_K": (256, 144)}   # ggml type -> (values, bytes) per block
FLOAT_KINDS = {"F32": np.float32, "F16": np.float16}


def _rng(seed: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(seed.encode()))


def q8_0_blocks(rows: int, cols: int, seed: str) -> np.ndarray:
    """Random Q8_0 rows, (rows, cols / 32 * 34) bytes."""
    rng = _rng(seed)
    blocks = np.empty((rows * cols // 32, 34), np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, size=(blocks.shape[0], 32), dtype=np.int8).view(np.uint8)
    d = (rng.uniform(0.5, 1.5, blocks.shape[0]) * 0.02 * 3 / 127).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def q4_k_blocks(rows: int, cols: int, seed: str) -> np.ndarray:
    """Random Q4_K rows, (rows, cols / 256 * 144) bytes."""
    rng = _rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        blocks[:, at:at + 2] = (rng.uniform(0.5, 1.5, blocks.shape[0]) * 6e-5).astype(np.float16) \
            .view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def quantisable(shape, kind: str) -> bool:
    """Whether a tensor of ``shape`` can be stored in the block type ``kind``: a matrix whose rows are whole blocks."""
    return len(shape) == 2 and shape[1] % BLOCKS[kind][0] == 0


def city96_q4_k(name: str, shape, blocks: tuple[str, ...]) -> str:
    """The type of a transformer's tensor in a Q4_K GGUF as city96's tools lay one out: the matrices of the blocks
    (names starting with ``blocks``) Q4_K, vectors and tensors of up to 1024 values F32, the other matrices
    (refiners, embedders, the final layer) F16."""
    if len(shape) < 2 or math.prod(shape) <= 1024:
        return "F32"
    return "Q4_K" if name.startswith(blocks) and quantisable(shape, "Q4_K") else "F16"


def nbytes(shape, kind: str) -> int:
    if kind in BLOCKS:
        values, size = BLOCKS[kind]
        return math.prod(shape) // values * size
    return math.prod(shape) * np.dtype(FLOAT_KINDS[kind]).itemsize


def write_gguf(path: Path, arch: str, items, kind, fields=None) -> None:
    """A GGUF file of ``items`` ((name, shape, make): ``make()`` gives the float tensor, torch or numpy, and is called
    only for the tensors kept as floats), each stored as ``kind(name, shape)`` says ("Q8_0", "Q4_K", "F16", "F32"),
    with ``fields(writer)`` adding the metadata."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if fields is not None:
        fields(writer)
    kinds = [kind(name, tuple(shape)) for name, shape, _ in items]
    for (name, shape, _), k in zip(items, kinds):
        if k in BLOCKS:
            byte_shape = (shape[0], shape[1] // BLOCKS[k][0] * BLOCKS[k][1])
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                                   raw_dtype=gguf.GGMLQuantizationType[k])
        else:
            dt = np.dtype(FLOAT_KINDS[k])
            writer.add_tensor_info(name, tuple(shape), dt, math.prod(shape) * dt.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (name, shape, make), k in zip(items, kinds):
        if k == "Q4_K":
            writer.write_tensor_data(q4_k_blocks(shape[0], shape[1], name))
        elif k == "Q8_0":
            writer.write_tensor_data(q8_0_blocks(shape[0], shape[1], name))
        else:
            t = make()
            t = t.float().numpy() if hasattr(t, "numpy") else np.asarray(t, np.float32)
            writer.write_tensor_data(np.ascontiguousarray(t.astype(FLOAT_KINDS[k])).reshape(tuple(shape)))
    writer.close()


def qwen3_fields(text):
    """The ``qwen3.*`` metadata llama.cpp's converter writes for a Qwen3 of config ``text``
    (:class:`sdlite.config.qwen.QwenConfig`), Q4_K_M as its file type (the tokenizer's entries are not read)."""
    def fields(writer):
        import gguf

        writer.add_context_length(text.max_position_embeddings)
        writer.add_embedding_length(text.hidden_size)
        writer.add_block_count(text.num_hidden_layers)
        writer.add_feed_forward_length(text.intermediate_size)
        writer.add_head_count(text.num_attention_heads)
        writer.add_head_count_kv(text.num_key_value_heads)
        writer.add_key_length(text.head_dim)
        writer.add_value_length(text.head_dim)
        writer.add_layer_norm_rms_eps(text.rms_norm_eps)
        writer.add_rope_freq_base(text.rope_theta)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    return fields
