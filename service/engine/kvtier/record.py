"""One stored block: a header saying what it is, and its K/V payload in one of the codecs.

    record = MAGIC | u32 header length | msgpack header | payload

NOTE (what a record must match to be used): the block hash it was asked for, the tier tag
(model, cache salt, dtype and layout, hashed), the model id, dtype, layout and block size of
the reading engine, a payload of exactly the length the header gives, and the payload's
CRC-32; then its codec must decode it to the layout's shape. A record failing any of these
is rejected with the reason (`Rejected.reason`), counted, deleted from its backend, and the
block recomputed; it is never used.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

MAGIC = b"PCKV\x01"
_LEN = struct.Struct("<I")


class Rejected(ValueError):
    """A record that must not be used: `reason` is malformed, foreign, truncated or checksum."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(slots=True, frozen=True)
class BlockLayout:
    """What one engine's blocks are: every stored block must match it to be read back."""

    model_id: str
    namespace: str  # the engine's hash namespace: model id and cache salt
    dtype: torch.dtype
    shape: tuple[int, int, int, int, int]  # [layers, 2 (K, V), block_size, kv_heads, head_dim]

    @property
    def block_size(self) -> int:
        return self.shape[2]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def raw_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def tag(self) -> str:
        """Keys live under this: engines that cannot use each other's blocks never meet."""
        text = f"{self.namespace}|{self.dtype_name}|{','.join(map(str, self.shape))}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def key(self, block_hash: int) -> str:
        return f"{self.tag}/{block_hash:016x}"


class Header(msgspec.Struct, array_like=True, frozen=True):
    block_hash: int
    tag: str
    model_id: str
    dtype: str
    layout: tuple[int, ...]
    block_size: int
    codec: str
    payload_bytes: int
    checksum: int  # CRC-32 of the payload


_SAME_WIDTH = {4: (torch.int32, np.int32), 2: (torch.int16, np.int16)}
_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(Header).decode


def checksum(payload: bytes | memoryview) -> int:
    """CRC-32: it catches what storage does to bytes (flips, cuts, stale files), several times
    faster than blake2b (docs/perf-history.md, "The third KV tier's storage options"); it is
    no defence against someone who can write the tier, who could as well write any K/V with a
    matching checksum."""
    return zlib.crc32(payload)


# ---------------------------------------------------------------------- codecs


def _raw_encode(block: torch.Tensor) -> memoryview:
    # block: [L, 2, bs, Hkv, D] in the pool's dtype; no copy when it is contiguous
    return memoryview(block.contiguous().view(torch.uint8).numpy().data).cast("B")


def _raw_decode(payload: bytes, layout: BlockLayout, out: torch.Tensor) -> None:
    if len(payload) != layout.raw_bytes:
        raise Rejected("malformed", f"raw payload of {len(payload)} bytes")
    # One copy, straight into `out` (a view of the run being loaded, strided or not), as the
    # integer type of the dtype's width: numpy has no bfloat16.
    as_int = _SAME_WIDTH[out.element_size()]
    dest = out.view(as_int[0]).numpy()
    np.copyto(dest, np.frombuffer(payload, dtype=as_int[1]).reshape(layout.shape))


def _int8_encode(block: torch.Tensor) -> bytes:
    """Symmetric int8 with one float32 scale per (layer, K/V, token, head): a token's K and V
    vectors are quantized on their own, so one outlier does not flatten a whole block."""
    x = block.float()  # [L, 2, bs, Hkv, D]
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0  # [L, 2, bs, Hkv, 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)  # [L, 2, bs, Hkv, D]
    return b"".join((_raw_encode(scale.squeeze(-1)), _raw_encode(q)))


def _int8_decode(payload: bytes, layout: BlockLayout, out: torch.Tensor) -> None:
    scales_shape = layout.shape[:4]
    n_scales = int(np.prod(scales_shape))
    if len(payload) != 4 * n_scales + int(np.prod(layout.shape)):
        raise Rejected("malformed", f"int8 payload of {len(payload)} bytes")
    scale = _from_bytes(payload[: 4 * n_scales], torch.uint8).view(torch.float32)
    q = _from_bytes(payload[4 * n_scales :], torch.uint8).view(torch.int8)
    x = q.reshape(layout.shape).float() * scale.reshape(*scales_shape, 1)  # [L, 2, bs, Hkv, D]
    out.copy_(x)


def _zstd() -> tuple[object, object]:
    import zstandard  # an optional wheel: only the zstd codecs need it

    return zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()


def _zstd_encode(data: bytes | memoryview) -> bytes:
    compressor, _ = _zstd()
    return bytes(compressor.compress(data))  # type: ignore[attr-defined]


def _zstd_decode(data: bytes, limit: int) -> bytes:
    _, decompressor = _zstd()
    try:
        out = decompressor.decompress(data, max_output_size=limit)  # type: ignore[attr-defined]
    except Exception as exc:  # zstandard.ZstdError: whatever the bytes were, they are unusable
        raise Rejected("malformed", f"zstd: {exc}") from None
    return bytes(out)


def encode_payload(codec: str, block: torch.Tensor) -> bytes | memoryview:
    if codec == "raw":
        return _raw_encode(block)
    if codec == "int8":
        return _int8_encode(block)
    if codec == "zstd":
        return _zstd_encode(_raw_encode(block))
    if codec == "int8-zstd":
        return _zstd_encode(_int8_encode(block))
    raise ValueError(f"unknown codec {codec!r}")


def decode_payload(codec: str, payload: bytes, layout: BlockLayout, out: torch.Tensor) -> None:
    """Decode into `out` ([L, 2, bs, Hkv, D] in the layout's dtype; any strides)."""
    limit = 2 * layout.raw_bytes  # a decompressed payload is never larger than raw
    if codec == "raw":
        _raw_decode(payload, layout, out)
    elif codec == "int8":
        _int8_decode(payload, layout, out)
    elif codec == "zstd":
        _raw_decode(_zstd_decode(payload, limit), layout, out)
    elif codec == "int8-zstd":
        _int8_decode(_zstd_decode(payload, limit), layout, out)
    else:
        raise Rejected("malformed", f"unknown codec {codec!r}")


def check_codec_available(codec: str) -> None:
    """Raise ValueError at start-up, not at the first write, if `codec` cannot run here."""
    if codec.endswith("zstd"):
        try:
            _zstd()
        except ImportError:
            raise ValueError(f"kv tier codec {codec} needs the zstandard wheel") from None


# ---------------------------------------------------------------------- records


def encode(block_hash: int, block: torch.Tensor, layout: BlockLayout, codec: str) -> bytes:
    """The record of one block [L, 2, bs, Hkv, D]."""
    if tuple(block.shape) != layout.shape or block.dtype != layout.dtype:
        raise ValueError(f"a block of {tuple(block.shape)} {block.dtype} is not {layout}")
    payload = encode_payload(codec, block)
    header = _encode_header(
        Header(
            block_hash=block_hash,
            tag=layout.tag,
            model_id=layout.model_id,
            dtype=layout.dtype_name,
            layout=layout.shape,
            block_size=layout.block_size,
            codec=codec,
            payload_bytes=len(payload),
            checksum=checksum(payload),
        )
    )
    return b"".join((MAGIC, _LEN.pack(len(header)), header, payload))


def decode(
    record: bytes, block_hash: int, layout: BlockLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The block [L, 2, bs, Hkv, D] in `record`, written into `out` if given (a view of the
    run being loaded: one copy), or Rejected saying why it cannot be used; then `out` may
    hold part of it and means nothing."""
    start = len(MAGIC) + _LEN.size
    if len(record) < start or not record.startswith(MAGIC):
        raise Rejected("malformed", "no record header")
    (header_len,) = _LEN.unpack_from(record, len(MAGIC))
    if len(record) < start + header_len:
        raise Rejected("truncated", "the header is cut short")
    try:
        header = _decode_header(record[start : start + header_len])
    except msgspec.DecodeError as exc:
        raise Rejected("malformed", f"header: {exc}") from None
    expected = (block_hash, layout.tag, layout.model_id, layout.dtype_name, layout.shape)
    found = (header.block_hash, header.tag, header.model_id, header.dtype, header.layout)
    if found != expected or header.block_size != layout.block_size:
        raise Rejected("foreign", f"a block of {found}, not {expected}")
    payload = record[start + header_len :]
    if len(payload) != header.payload_bytes:
        raise Rejected("truncated", f"{len(payload)} of {header.payload_bytes} payload bytes")
    if checksum(payload) != header.checksum:
        raise Rejected("checksum", "the payload does not match its checksum")
    if out is None:
        out = torch.empty(layout.shape, dtype=layout.dtype)
    decode_payload(header.codec, payload, layout, out)
    return out


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A writable tensor holding a copy of `data` (torch warns on read-only buffers)."""
    out = torch.empty(len(data), dtype=torch.uint8)
    out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out.view(dtype) if dtype is not torch.uint8 else out
