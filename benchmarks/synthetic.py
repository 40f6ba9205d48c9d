"""Llama-shaped models with random weights, built straight on the device, for speed work.

No large checkpoint reaches the GPU machine (it has no network, and only a small working tree
travels there), so the engine is timed on the shapes of real models with random weights drawn
where they run. A decode step over random weights reads the same bytes and does the same
arithmetic as over trained ones, so timings carry over; nothing about quality does, and every
figure taken on these models says that its weights were random.

Shapes (`SHAPES`): `smollm2-135m` (the bundled model's), `llama-3.2-1b`, `llama-3-8b` (32
layers, 32 query / 8 KV heads of 128, hidden 4096, MLP 14336, vocabulary 128256), and `tiny`
for tests on the CPU. Contexts are capped at 8192 positions (the RoPE tables); Llama 3's RoPE
frequency scaling is left out (it changes no timing).

The tokenizer (`synthetic_tokenizer`) is made up too, so that nothing but this file is needed:
one token per character of printable ASCII and newline, the ChatML specials, and filler tokens
(` w123`) up to the vocabulary's size, so every id the model can pick decodes to text.

    python -m benchmarks.synthetic shapes                           # sizes, bytes per decode step
    python -m benchmarks.synthetic serve --shape llama-3-8b [pagechat serve options]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from service.engine.loader import LoadedModel
from service.engine.model import DecoderModel, ModelArgs
from service.engine.tokenizer import Tokenizer

_CONTEXT = 8192
SHAPES: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=49152,  # the benchmarks' prompts draw ids below the bundled vocabulary's size
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
    "smollm2-135m": ModelArgs(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=_CONTEXT,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": ModelArgs(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=_CONTEXT,
        tie_word_embeddings=True,
    ),
    "llama-3-8b": ModelArgs(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=_CONTEXT,
    ),
}

SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def random_weights(
    args: ModelArgs, *, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every weight `DecoderModel.from_weights` takes, drawn on `device` in `dtype`.

    Projections ~ N(0, 1/fan_in), so activations keep their scale through 32 layers in bf16;
    the embedding ~ N(0, 1); norm weights 1. Same seed, device and dtype: same weights.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        weight = torch.empty(rows, cols, dtype=dtype, device=device)  # [out, in]
        return weight.normal_(0.0, std, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    h, i = args.hidden_size, args.intermediate_size
    weights = {
        "embed_tokens.weight": normal(args.vocab_size, h, 1.0),
        "norm.weight": ones(h),
    }
    if not args.tie_word_embeddings:
        weights["lm_head.weight"] = normal(args.vocab_size, h, h**-0.5)
    for layer in range(args.num_layers):
        p = f"layers.{layer}."
        weights |= {
            p + "attn_norm.weight": ones(h),
            p + "attn.qkv.weight": normal(args.q_size + 2 * args.kv_size, h, h**-0.5),
            p + "attn.o_proj.weight": normal(h, args.q_size, args.q_size**-0.5),
            p + "mlp_norm.weight": ones(h),
            p + "mlp.gate_up.weight": normal(2 * i, h, h**-0.5),
            p + "mlp.down.weight": normal(h, i, i**-0.5),
        }
    return weights


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """Characters, ChatML specials and filler up to `vocab_size`: any text encodes (unknown
    characters to <unk>), every id decodes to text, and the chat template is ChatML's."""
    base = [*SPECIAL_TOKENS, *(chr(c) for c in range(32, 127)), "\n"]
    if vocab_size < len(base):
        raise ValueError(f"the vocabulary needs at least {len(base)} tokens, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(base)}
    vocab |= {f" w{i}": i for i in range(len(base), vocab_size)}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return Tokenizer(
        backend, chat_template=CHAT_TEMPLATE, eos_token_ids=[vocab["<|im_end|>"]], bos_token_id=None
    )


def build(
    shape: str, *, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> LoadedModel:
    """The model of `shape` with random weights on `device`, ready for `LLMEngine(config,
    loaded=...)`; its name says that the weights are random."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    args = SHAPES[shape]
    weights = random_weights(args, device=device, dtype=dtype, seed=seed)
    model = DecoderModel.from_weights(args, weights, dtype, device)
    return LoadedModel(
        model=model,
        args=args,
        tokenizer=synthetic_tokenizer(args.vocab_size),
        model_id=f"synthetic-{shape}-seed{seed}",
        name=f"{shape} (random weights)",
        family="llama",
    )


def weight_read_bytes(model: DecoderModel) -> int:
    """Bytes of weights one decode step must read: every parameter, except an untied
    embedding, of which a step reads only its batch's rows (a tied one is the LM head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= sum(p.numel() * p.element_size() for p in model.embed_tokens.parameters())
    return total


def parameter_count(args: ModelArgs) -> int:
    h, i = args.hidden_size, args.intermediate_size
    per_layer = h * (args.q_size + 2 * args.kv_size) + args.q_size * h + 3 * h * i + 2 * h
    head = 0 if args.tie_word_embeddings else args.vocab_size * h
    return args.vocab_size * h + head + h + args.num_layers * per_layer


def _shapes() -> int:
    print("| shape | layers | q/kv heads x dim | hidden | MLP | vocab | parameters | bf16 GB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, a in SHAPES.items():
        n = parameter_count(a)
        print(
            f"| {name} | {a.num_layers} | {a.num_heads}/{a.num_kv_heads} x {a.head_dim} | "
            f"{a.hidden_size} | {a.intermediate_size} | {a.vocab_size} | {n / 1e9:.3f} B | "
            f"{2 * n / 1e9:.2f} |"
        )
    return 0


def _serve(argv: Sequence[str]) -> int:
    """`pagechat serve` over a synthetic model built in this process."""
    from service.engine.plan import plan_engine
    from service.server.options import add_arguments, config_from_args
    from service.server.serve import serve

    parser = argparse.ArgumentParser(prog="benchmarks.synthetic serve")
    parser.add_argument("--shape", choices=list(SHAPES), required=True)
    parser.add_argument("--weights-seed", type=int, default=0)
    add_arguments(parser)
    args = parser.parse_args(argv)
    plan = plan_engine(config_from_args(args).engine)
    loaded = build(
        args.shape, device=plan.device, dtype=plan.activation_dtype, seed=args.weights_seed
    )
    return serve(args, loaded)


USAGE = """usage: python -m benchmarks.synthetic shapes
       python -m benchmarks.synthetic serve --shape SHAPE [pagechat serve options]"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["shapes"]:
        return _shapes()
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
