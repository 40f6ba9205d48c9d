"""The structs of pagechat_cpu.h that Python fills, as ctypes mirrors, and their check.

ctypes lays a mirror out from its `_fields_` alone: a field added, moved or widened on one side
only would pass shifted pointers to the kernels in silence. So the library reports how the
compiler laid out each struct (abi.c, `pc_struct_layouts`: its size, each field's name,
offset and size), and `check_layouts` compares every mirror with it when the library loads
(kernels/cpu/library.py), refusing a library that differs.
"""

from __future__ import annotations

import ctypes

P = ctypes.c_void_p
I64 = ctypes.c_int64
F32 = ctypes.c_float

# pagechat_cpu.h's limits: the weights of one projection, the layer groups with a pool each,
# the RoPE tables a step carries.
MAX_PARTS = 3
MAX_GROUPS = 2
MAX_ROPES = 2

# pc_kernels' fields, in its order: the kernels a decode step runs, then the int8 products'
# entries (NULL with fp32 inputs).
STACK_KERNELS = ("gemv", "attend", "rms_norm", "rope_write", "silu_mul", "gelu_tanh_mul")
INT8_TABLE_FIELDS = ("prepared_bytes", "prepare", "gemv_prepared")


class CKernels(ctypes.Structure):
    """pc_kernels: the table of chosen versions stack.c calls through."""

    _fields_ = [(name, P) for name in (*STACK_KERNELS, *INT8_TABLE_FIELDS)]


class CAttention(ctypes.Structure):
    """pc_attention: one layer's attention over the paged cache, for a range of rows."""

    _fields_ = [
        ("q", P),
        ("q_stride", I64),
        ("k_cache", P),
        ("v_cache", P),
        ("cache_type", I64),
        ("slots", P),
        ("slot_stride", I64),
        ("seq_lens", P),
        ("out", P),
        ("scores", P),
        ("hq", I64),
        ("hkv", I64),
        ("d", I64),
        ("scale", F32),
        ("peaks", P),
        ("totals", P),
    ]


class CWeight(ctypes.Structure):
    """pc_weight: GGUF blocks, n rows of row_bytes."""

    _fields_ = [("type", I64), ("n", I64), ("k", I64), ("row_bytes", I64), ("data", P)]


class CProjection(ctypes.Structure):
    """pc_projection: up to MAX_PARTS weights of one k whose outputs follow one another."""

    _fields_ = [("part", CWeight * MAX_PARTS), ("parts", I64), ("n", I64), ("k", I64)]


class CDecoderLayer(ctypes.Structure):
    """pc_decoder_layer: one decoder layer's weights and caches (NULL: a feature the family
    lacks)."""

    _fields_ = [
        ("proj", CProjection * 4),  # qkv, o_proj, gate_up, down
        ("attn_norm", P),
        ("mlp_norm", P),
        ("k_cache", P),  # [slots, Hkv, D] of the shape's cache_type
        ("v_cache", P),
        ("qkv_bias", P),
        ("o_bias", P),
        ("q_norm", P),
        ("k_norm", P),
        ("post_attn_norm", P),
        ("post_mlp_norm", P),
        ("group", I64),
        ("rope", I64),
        ("window", I64),  # 0: the whole context
    ]


class CDecoderShape(ctypes.Structure):
    """pc_decoder_shape: the model's sizes and the KV pools' (the latter set by DecoderStack)."""

    _fields_ = [
        ("num_layers", I64),
        ("hidden", I64),
        ("intermediate", I64),
        ("num_q_heads", I64),
        ("num_kv_heads", I64),
        ("head_dim", I64),
        ("rms_norm_eps", F32),
        ("scale", F32),  # the attention's, on q . k
        ("activation", I64),  # stack.ACTIVATIONS
        ("block_size", I64),
        ("cache_type", I64),
        ("groups", I64),
        ("cache_blocks", I64 * MAX_GROUPS),
        ("batch_invariant", I64),  # 1: a lone sequence's context never split between threads
    ]


class CStepRows(ctypes.Structure):
    """pc_step_rows: a step's rows, built per call from `StackRows` and the RoPE rows."""

    _fields_ = [
        ("m", I64),
        ("seq_lens", P),
        ("cos", P * MAX_ROPES),
        ("sin", P * MAX_ROPES),
        ("write_slots", P * MAX_GROUPS),
        ("block_tables", P * MAX_GROUPS),
        ("table_width", I64 * MAX_GROUPS),
    ]


# Each mirror by the C name of its struct.
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "pc_attention": CAttention,
    "pc_kernels": CKernels,
    "pc_weight": CWeight,
    "pc_projection": CProjection,
    "pc_decoder_layer": CDecoderLayer,
    "pc_decoder_shape": CDecoderShape,
    "pc_step_rows": CStepRows,
}


class _FieldLayout(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", I64), ("size", I64)]


class _StructLayout(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("size", I64),
        ("fields", I64),
        ("field", ctypes.POINTER(_FieldLayout)),
    ]


class LayoutMismatch(RuntimeError):
    """The library lays out a struct otherwise than its ctypes mirror."""


# a struct's size, then (name, offset, size) of each field in order
Layout = tuple[int, tuple[tuple[str, int, int], ...]]


def library_layouts(lib: ctypes.CDLL) -> dict[str, Layout]:
    """Every struct's layout as the library was compiled: name -> (size, fields)."""
    fn = lib.pc_struct_layouts
    fn.restype, fn.argtypes = ctypes.POINTER(_StructLayout), (ctypes.POINTER(I64),)
    count = I64()
    table = fn(ctypes.byref(count))
    layouts = {}
    for i in range(count.value):
        struct = table[i]
        fields = tuple((f.name.decode(), f.offset, f.size) for f in struct.field[: struct.fields])
        layouts[struct.name.decode()] = (struct.size, fields)
    return layouts


def mirror_layout(mirror: type[ctypes.Structure]) -> Layout:
    fields = tuple(
        (name, getattr(mirror, name).offset, getattr(mirror, name).size)
        for name, *_ in mirror._fields_
    )
    return ctypes.sizeof(mirror), fields


def check_layouts(
    lib: ctypes.CDLL, mirrors: dict[str, type[ctypes.Structure]] | None = None
) -> None:
    """Raise LayoutMismatch naming the first struct (and field) that `lib` lays out otherwise
    than its mirror, or that one side lacks."""
    mirrors = MIRRORS if mirrors is None else mirrors
    compiled = library_layouts(lib)
    if missing := sorted(mirrors.keys() - compiled.keys()):
        raise LayoutMismatch(f"the library reports no layout of {', '.join(missing)}")
    for name, mirror in mirrors.items():
        size, fields = compiled[name]
        mirror_size, mirror_fields = mirror_layout(mirror)
        for c_field, py_field in zip(fields, mirror_fields, strict=False):
            if c_field != py_field:
                raise LayoutMismatch(
                    f"{name}: the library has {_described(c_field)}, "
                    f"{mirror.__name__} has {_described(py_field)}"
                )
        if len(fields) != len(mirror_fields) or size != mirror_size:
            raise LayoutMismatch(
                f"{name}: the library has {len(fields)} fields in {size} bytes, "
                f"{mirror.__name__} {len(mirror_fields)} in {mirror_size}"
            )


def _described(field: tuple[str, int, int]) -> str:
    name, offset, size = field
    return f"{name} at byte {offset} ({size} bytes)"
