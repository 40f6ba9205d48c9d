"""The C interface between kernels/cpu's Python and its library: every struct Python fills laid
out as the compiler lays it out (checked at load, `structs.check_layouts`), and every entry
point declared to ctypes as pagechat_cpu.h declares it."""

from __future__ import annotations

import ctypes
import re

import pytest

from kernels.cpu import build, structs
from kernels.cpu.library import F32, I64, ONCE_PROTOTYPES, PER_ISA_PROTOTYPES, P, library

HEADER = (build.SOURCE_DIR / "pagechat_cpu.h").read_text()


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    loaded = library()
    assert loaded is not None, "the CPU kernels did not build"
    return loaded


def test_every_mirror_is_laid_out_as_the_library_lays_out_its_struct(lib: ctypes.CDLL) -> None:
    compiled = structs.library_layouts(lib)
    assert compiled.keys() == structs.MIRRORS.keys()
    for name, mirror in structs.MIRRORS.items():
        assert compiled[name] == structs.mirror_layout(mirror), name
    structs.check_layouts(lib)


class _SwappedWeight(ctypes.Structure):  # pc_weight with n and k the other way round
    _fields_ = [("type", I64), ("k", I64), ("n", I64), ("row_bytes", I64), ("data", P)]


class _NarrowWeight(ctypes.Structure):  # pc_weight with a 32-bit type
    _fields_ = [("type", ctypes.c_int32), ("n", I64), ("k", I64), ("row_bytes", I64), ("data", P)]


class _LongerWeight(ctypes.Structure):  # pc_weight with a field the C side lacks
    _fields_ = [*structs.CWeight._fields_, ("extra", I64)]


@pytest.mark.parametrize(
    ("mirror", "message"),
    [
        (_SwappedWeight, "the library has n at byte 8 (8 bytes), _SwappedWeight has k at byte 8"),
        (_NarrowWeight, "type at byte 0 (8 bytes), _NarrowWeight has type at byte 0 (4 bytes)"),
        (_LongerWeight, "pc_weight: the library has 5 fields in 40 bytes, _LongerWeight 6 in 48"),
    ],
)
def test_a_mismatched_mirror_is_refused_naming_the_field(
    lib: ctypes.CDLL, mirror: type[ctypes.Structure], message: str
) -> None:
    with pytest.raises(structs.LayoutMismatch, match=re.escape(message)):
        structs.check_layouts(lib, {"pc_weight": mirror})


def test_a_struct_the_library_does_not_report_is_refused(lib: ctypes.CDLL) -> None:
    with pytest.raises(structs.LayoutMismatch, match="no layout of pc_missing"):
        structs.check_layouts(lib, {"pc_missing": structs.CWeight})


def _ctypes_of(c_type: str) -> type | None:
    c_type = c_type.strip()
    if c_type == "void":
        return None
    if c_type == "const char *":
        return ctypes.c_char_p
    if "*" in c_type:
        return P
    return {"int64_t": I64, "float": F32}[c_type]


def _parameters(declaration: str) -> tuple[type | None, ...]:
    # "const float *x" -> "const float *"; "int64_t n" -> "int64_t"
    params = [p.strip() for p in declaration.split(",") if p.strip() not in ("", "void")]
    return tuple(_ctypes_of(re.sub(r"\w+$", "", p)) for p in params)


def _function_types() -> dict[str, tuple[type | None, tuple[type | None, ...]]]:
    """pagechat_cpu.h's `typedef <result> pc_<kind>_fn(<parameters>);`, as ctypes types."""
    found = re.findall(r"typedef (\w+) (pc_\w+_fn)\(([^)]*)\);", HEADER)
    return {name: (_ctypes_of(result), _parameters(params)) for result, name, params in found}


def _header_per_isa() -> dict[str, str]:
    """kernel -> its function type, from PC_DECLARE_VERSION's lines."""
    macro = HEADER[HEADER.index("#define PC_DECLARE_VERSION(isa)") :].split("\n\n", 1)[0]
    kernels = {}
    for fn_type, names in re.findall(r"(pc_\w+_fn) ([^;]+);", macro):
        for name in names.split(","):
            kernels[re.fullmatch(r"pc_(\w+)_##isa", name.strip()).group(1)] = fn_type  # type: ignore[union-attr]
    return kernels


def test_every_version_entry_point_is_declared_to_ctypes_as_the_header_declares_it() -> None:
    types = _function_types()
    declared = _header_per_isa()
    assert declared.keys() == PER_ISA_PROTOTYPES.keys()
    for kernel, fn_type in declared.items():
        assert PER_ISA_PROTOTYPES[kernel] == types[fn_type], kernel
    for isa in build.isas(build.machine()):
        assert f"PC_DECLARE_VERSION({isa.name})" in HEADER


def test_every_entry_point_compiled_once_is_declared_to_ctypes_as_the_header_declares_it() -> None:
    for name, prototype in ONCE_PROTOTYPES.items():
        match = re.search(rf"\n(\w+) {name}\(([^)]*)\);", HEADER)
        assert match is not None, f"{name} is not declared in pagechat_cpu.h"
        assert prototype == (_ctypes_of(match.group(1)), _parameters(match.group(2))), name
