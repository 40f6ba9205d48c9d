"""Test models of the sizes people serve on a CPU, made here: random weights in the real shapes of
Llama-3.2-1B, Qwen2.5-1.5B and Llama-3.2-3B, converted and quantized by llama.cpp's own tools.

The bundled 135M model hides what bounds a real one (at its size per-token overheads dominate
every engine). These models give real speed and noise text: `transformers` builds each from its
config with random weights and the bundled SmolLM2 tokenizer (49,152 tokens, so the embedding is
smaller than the real models'), saves it in fp16, then the llama.cpp tree that
scripts/build-llama-server.sh builds converts it (`convert_hf_to_gguf.py --outtype f16`) and
quantizes it (`llama-quantize`, the types asked for). Answers are noise: benchmarks send
`ignore_eos` so that every answer runs to `max_tokens`.

    .venv/bin/python -m benchmarks.test_models [--shape llama-3.2-1b qwen2.5-1.5b] \\
        [--quant Q4_K_M Q5_K_M Q8_0] [--out build/models]

prints each file's path; a file already there is kept. ~3 minutes and ~2 GB of disk for the
1B shape's three files on 2 cores (the fp16 checkpoint and GGUF are deleted afterwards).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from service.engine.loader import default_model_path

LLAMA_ROOT = Path("build/llama.cpp")
LLAMA_TREE = LLAMA_ROOT / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
QUANTIZE = LLAMA_ROOT / "bin" / "llama-quantize"
DEFAULT_OUT = Path("build/models")


@dataclass(frozen=True, slots=True)
class Shape:
    """A model family's config fields for one real model's shape (its published config.json,
    with the bundled tokenizer's vocabulary)."""

    family: str  # transformers' model_type
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    extra: tuple[tuple[str, object], ...] = ()


LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip
SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0,
                          (("rope_scaling", LLAMA3_ROPE), ("max_position_embeddings", 131072))),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 1000000.0,
                          (("max_position_embeddings", 32768),)),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 500000.0,
                          (("rope_scaling", LLAMA3_ROPE), ("max_position_embeddings", 131072))),
}  # fmt: skip
QUANTS = ("Q4_K_M", "Q5_K_M", "Q8_0", "Q6_K", "Q4_0")


def model_path(out: Path, shape: str, quant: str) -> Path:
    return out / f"{shape}-random-{quant.lower()}.gguf"


def save_checkpoint(shape: Shape, directory: Path) -> None:
    """The random-weight model of `shape` in fp16 with the bundled tokenizer, as a Hugging
    Face directory (config.json, model.safetensors, the tokenizer's files)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    bundled = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(bundled.parent, gguf_file=bundled.name)
    config = AutoConfig.for_model(
        shape.family,
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **dict(shape.extra),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float16)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    """Run a tool quietly; on failure, raise with the end of what it printed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{command[:2]} failed ({done.returncode}): {done.stderr[-2000:]}")


def convert(directory: Path, f16: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(LLAMA_TREE / "gguf-py")}
    _run([sys.executable, str(LLAMA_TREE / "convert_hf_to_gguf.py"), str(directory),
          "--outtype", "f16", "--outfile", str(f16)], env)  # fmt: skip


def quantize(f16: Path, out: Path, quant: str, threads: int) -> None:
    _run([str(QUANTIZE), str(f16), str(out), quant, str(threads)])


def make(shape: str, quants: list[str], out: Path, threads: int) -> list[Path]:
    """The files of `shape` in each of `quants` under `out`; existing ones are kept."""
    wanted = {q: model_path(out, shape, q) for q in quants}
    missing = {q: p for q, p in wanted.items() if not p.is_file()}
    if missing:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out) as work:
            checkpoint, f16 = Path(work) / "hf", Path(work) / "f16.gguf"
            save_checkpoint(SHAPES[shape], checkpoint)
            convert(checkpoint, f16)
            shutil.rmtree(checkpoint)
            for quant, path in missing.items():
                partial = path.with_suffix(".partial")
                quantize(f16, partial, quant, threads)
                partial.replace(path)
    return list(wanted.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["llama-3.2-1b"], choices=sorted(SHAPES))
    parser.add_argument("--quant", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q8_0"], choices=QUANTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if not QUANTIZE.is_file():
        print(f"no {QUANTIZE}: run scripts/build-llama-server.sh (make llama-server) first")
        return 1
    for shape in args.shape:
        for path in make(shape, args.quant, args.out, args.threads):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
