"""record.py: a block survives encode/decode, and a record that does not fit is rejected."""

from __future__ import annotations

import pytest
import torch

from service.engine.kvtier import record
from service.engine.kvtier.record import Rejected
from tests.engine.kvtier.conftest import blocks, layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_lossless_codecs_give_back_the_exact_bytes(codec: str, dtype: torch.dtype) -> None:
    lay = layout(dtype=dtype)
    block = blocks(1, dtype=dtype)[:, :, 0]
    data = record.encode(7, block, lay, codec)
    assert torch.equal(record.decode(data, 7, lay), block)


@pytest.mark.parametrize("codec", ["int8", "int8-zstd"])
def test_int8_codecs_are_within_half_a_step_of_each_vectors_scale(codec: str) -> None:
    lay = layout()
    block = blocks(1)[:, :, 0]  # [L, 2, bs, H, D]
    back = record.decode(record.encode(7, block, lay, codec), 7, lay)
    step = block.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - block).abs() <= step / 2 + 1e-7).all()
    assert back.dtype == block.dtype


def test_int8_is_about_a_quarter_of_raw_float32() -> None:
    block = blocks(1)[:, :, 0]
    raw = len(record.encode_payload("raw", block))
    int8 = len(record.encode_payload("int8", block))
    # One byte per element plus a float32 scale per head_dim (8 here) elements.
    assert int8 == raw // 4 + raw // 8


def test_an_all_zero_vector_round_trips_under_int8() -> None:
    lay = layout()
    block = torch.zeros(lay.shape)
    assert torch.equal(record.decode(record.encode(1, block, lay, "int8"), 1, lay), block)


def _reason(data: bytes, block_hash: int, lay: record.BlockLayout) -> str:
    with pytest.raises(Rejected) as info:
        record.decode(data, block_hash, lay)
    return info.value.reason


def test_a_flipped_payload_byte_fails_the_checksum() -> None:
    lay = layout()
    data = bytearray(record.encode(3, blocks(1)[:, :, 0], lay, "raw"))
    data[-5] ^= 0x40
    assert _reason(bytes(data), 3, lay) == "checksum"


def test_a_truncated_record_is_rejected_as_truncated() -> None:
    lay = layout()
    data = record.encode(3, blocks(1)[:, :, 0], lay, "raw")
    assert _reason(data[:-1], 3, lay) == "truncated"
    assert _reason(data[:12], 3, lay) == "truncated"  # the header itself cut short


def test_garbage_is_rejected_as_malformed() -> None:
    lay = layout()
    assert _reason(b"", 3, lay) == "malformed"
    assert _reason(b"not a record at all", 3, lay) == "malformed"
    good = record.encode(3, blocks(1)[:, :, 0], lay, "raw")
    broken_header = good[:9] + b"\xc1" * 20 + good[29:]
    assert _reason(broken_header, 3, lay) == "malformed"


def test_a_block_of_another_model_dtype_layout_or_hash_is_foreign() -> None:
    ours = layout("model-a")
    block = blocks(1)[:, :, 0]
    theirs = record.encode(3, block, layout("model-b"), "raw")
    assert _reason(theirs, 3, ours) == "foreign"
    bf16 = record.encode(3, block.bfloat16(), layout("model-a", torch.bfloat16), "raw")
    assert _reason(bf16, 3, ours) == "foreign"
    assert _reason(record.encode(4, block, ours, "raw"), 3, ours) == "foreign"


def test_layout_tags_differ_by_namespace_dtype_and_shape() -> None:
    a = layout("m")
    salted = record.BlockLayout("m", "m|tenant-salt", torch.float32, a.shape)
    assert len({a.tag, salted.tag, layout("m", torch.bfloat16).tag, layout("n").tag}) == 4
    assert a.key(255) == f"{a.tag}/00000000000000ff"


def test_encode_refuses_a_block_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError):
        record.encode(1, torch.zeros(1, 2, 3), layout(), "raw")
