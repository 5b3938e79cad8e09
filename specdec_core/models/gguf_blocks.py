"""A GGUF file's own quantized blocks as our kernel's weights, every value unchanged (docs/QUANT.md, "The file's own
blocks").

Each tensor type maps onto a kernel format (vnni.FORMATS) that holds its codes and scales as they are:
- Q4_K and Q6_K: the K formats (vnni.pack_super): per 256 inputs the file's float16 d (and dmin), its integer
  sub-scales and mins as it packs them (Q4_K's 6-bit ones per 32 inputs, Q6_K's int8 ones per 16), w = d * sc * q -
  dmin * m; Q6_K's offset of 32 is a min of 32 * sc with dmin = 32 d (which the kernel computes, exactly, in
  float32). Their bytes are the file's.
- Q4_1: the int4 group format, scale d and min m per 32 inputs (w = d * q + m).
- Q5_0: the int6 group format with codes 0..31, scale d and min -16 d (w = d * (q - 16)).
- Q8_0: the int8 group format with codes q + 128, scale d and min -128 d (w = d * q).
The mins -16 d and -128 d are powers of two times a float16, so exact (an overflow is refused). Repacking
reads the file's bytes (memory-mapped, with the gguf package) and rearranges them; nothing is rounded.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn
from gguf import GGMLQuantizationType, GGUFReader, MODEL_ARCH_NAMES, dequantize, get_tensor_name_map

from . import vnni

SUPPORTED = ("Q4_K", "Q6_K", "Q4_1", "Q5_0", "Q8_0")


class UnsupportedTensor(ValueError):
    """A GGUF tensor whose type has no kernel format here."""


def _halves(blocks: np.ndarray, start: int, size: int) -> np.ndarray:
    """Float16 fields of `size` bytes at `start` of each block, as float16 [..., size / 2]."""
    return np.ascontiguousarray(blocks[..., start:start + size]).view(np.float16)


def _exact_half(values: np.ndarray, what: str) -> np.ndarray:
    """float32 values (a float16 times a power of two) as float16, refused where they overflow."""
    half = values.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), values):
        raise UnsupportedTensor(f"{what} does not fit float16 exactly")
    return half


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., B] as codes [..., 2, B]: the low nibbles, then the high ones (the file's order of inputs)."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def repack(data: np.ndarray, qtype: str, rows: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF tensor's bytes [rows, bytes per row] of type `qtype` as (packed, scale_min) for VnniLinear."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731 (numpy to torch, one copy at most)
    if qtype == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        blocks = data.reshape(rows, -1, 144)
        d, dmin = _halves(blocks, 0, 2)[..., 0], _halves(blocks, 2, 2)[..., 0]
        codes = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32)).reshape(rows, inputs)
        return vnni.pack_super(t(codes), t(blocks[..., 4:16].reshape(rows, -1)), t(d), t(dmin), bits=4)
    if qtype == "Q6_K":  # 128 bytes of low nibbles, 64 of top 2 bits, 16 int8 scales, d
        blocks = data.reshape(rows, -1, 210)
        low = _nibbles(blocks[..., :128].reshape(rows, -1, 2, 64))  # [rows, S, half, 2, 64]
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 32)
        high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-2)  # [rows, S, half, 4, 32]
        codes = low.reshape(rows, inputs) | high.reshape(rows, inputs) << 4
        scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1)
        return vnni.pack_super(t(codes), t(scales), t(_halves(blocks, 208, 2)[..., 0]), None, bits=6)
    if qtype == "Q4_1":  # d, m, 16 bytes of nibbles
        blocks = data.reshape(rows, -1, 20)
        codes = _nibbles(blocks[..., 4:]).reshape(rows, inputs)
        return vnni.pack(t(codes), t(_halves(blocks, 0, 2)[..., 0]), t(_halves(blocks, 2, 2)[..., 0]), bits=4)
    if qtype == "Q5_0":  # d, 32 top bits, 16 bytes of nibbles
        blocks = data.reshape(rows, -1, 22)
        top = np.ascontiguousarray(blocks[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32) & 1
        codes = _nibbles(blocks[..., 6:]).reshape(rows, -1, 32) | top.astype(np.uint8) << 4
        d = _halves(blocks, 0, 2)[..., 0]
        mins = _exact_half(d.astype(np.float32) * -16, "Q5_0's -16 d")
        return vnni.pack(t(codes.reshape(rows, inputs)), t(d), t(mins), bits=6)
    if qtype == "Q8_0":  # d, 32 int8 codes
        blocks = data.reshape(rows, -1, 34)
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.int16) + 128
        d = _halves(blocks, 0, 2)[..., 0]
        mins = _exact_half(d.astype(np.float32) * -128, "Q8_0's -128 d")
        return vnni.pack(t(codes.reshape(rows, inputs)), t(d), t(mins), bits=8)
    raise UnsupportedTensor(f"GGUF type {qtype} has no kernel format here (these do: {', '.join(SUPPORTED)})")


class GgufFile:
    """A GGUF file's linear weights by the names of a transformers model's modules."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFReader(self.path)  # memory-mapped: a tensor's bytes are read when repacked
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}

    @cached_property
    def architecture(self) -> str:
        field = self.reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()

    def _field(self, key: str) -> int:
        field = self.reader.fields[f"{self.architecture}.{key}"]
        return int(field.parts[field.data[0]][0])

    @cached_property
    def _names(self):
        arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == self.architecture)
        return get_tensor_name_map(arch, self._field("block_count"))

    def tensor_name(self, module: str, tied_head: bool) -> str:
        """The GGUF tensor of a module's weight (`lm_head` of a model whose head is tied: the embeddings)."""
        name = self._names.get_name(module)
        if name is None:
            raise KeyError(f"{module} has no tensor in {self.path.name}")
        if name == "output" and tied_head and "output.weight" not in self.tensors:
            name = "token_embd"
        return f"{name}.weight"

    def _rows(self, tensor) -> np.ndarray:
        """A tensor's rows in transformers' order: llama.cpp's converter interleaves the rows of a LLaMA model's q and k
        for its rotary embedding, and they are put back here, whole rows, as transformers' own GGUF loader does."""
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        if self.architecture != "llama" or not tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            return np.asarray(tensor.data)
        heads = self._field("attention.head_count" if "attn_q" in tensor.name else "attention.head_count_kv")
        return np.asarray(tensor.data)[np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)]

    def linear(self, module: str, tied_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scale_min) of a linear module's weight, from the file's blocks (UnsupportedTensor for other types)."""
        tensor = self.tensors[self.tensor_name(module, tied_head)]
        inputs, rows = (int(v) for v in tensor.shape)
        return repack(self._rows(tensor), GGMLQuantizationType(tensor.tensor_type).name, rows, inputs)

    def values(self, parameter: str, tied_head: bool = False) -> torch.Tensor | None:
        """A model parameter's values as the file holds them, in float32 (the gguf package's dequantization); None
        where the file has no tensor for it."""
        module, _, kind = parameter.rpartition(".")
        try:
            name = self.tensor_name(module, tied_head).removesuffix(".weight") + f".{kind}"
        except KeyError:
            return None
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        shape = [int(v) for v in reversed(tensor.shape)]
        return torch.from_numpy(np.array(dequantize(self._rows(tensor), tensor.tensor_type)).reshape(shape))  # a copy: the file is read-only

    def embedding(self, dtype: torch.dtype) -> GgufEmbedding:
        """The token embeddings as the file's own rows (GgufEmbedding)."""
        tensor = self.tensors["token_embd.weight"]
        return GgufEmbedding(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type), int(tensor.shape[0]), dtype)


class GgufEmbedding(nn.Module):
    """Token embeddings as the GGUF file's rows (memory-mapped), each dequantized when looked up by the gguf package:
    the 1.5B's Q4_K rows are 131 MB where bf16 would take 467 MB, and nothing is converted at start. A row comes out
    in the model's dtype: the file's value rounded to it once, as the bf16 conversion's embeddings hold it."""

    def __init__(self, rows: np.ndarray, qtype: GGMLQuantizationType, dim: int, dtype: torch.dtype):
        super().__init__()
        self.rows, self.qtype = rows, qtype
        self.num_embeddings, self.embedding_dim = rows.shape[0], dim
        # Carries the output dtype through .to() / .float(), as a weight would.
        self.register_buffer("like", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        values = torch.from_numpy(np.array(dequantize(self.rows[ids], self.qtype)).reshape(len(ids), self.embedding_dim))
        return values.to(self.like.dtype).reshape(*input_ids.shape, self.embedding_dim).to(input_ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} rows"
