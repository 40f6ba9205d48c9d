"""pagechat's perplexity against llama.cpp's `llama-perplexity` on the same GGUF and text, by
llama-perplexity's own protocol, so the two figures are the same measure.

llama-perplexity tokenizes the whole text (BOS first), cuts it into chunks of `--ctx` tokens
(the last partial one dropped), starts every chunk with BOS, and scores each chunk's second half
only: the tokens from `ctx / 2 + 1` on, each predicted from those before it in its chunk. Ours
does the same with pagechat's tokenizer and model (weights as the file stores them, through the
CPU kernels, fp32 activations; each layer's sliding window honoured), so what differs is the
arithmetic (llama.cpp's Q8 activations against our fp32) and any token the two tokenizers cut
differently (the token counts are printed side by side).

    make llama-server    # builds llama-server and llama-perplexity
    .venv/bin/python -m benchmarks.llama_perplexity --model FILE.gguf [--ctx 512]
        [--chunks N] [--threads 2] [--json results/llama-perplexity.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.perplexity import TEXT, window_logits
from kernels.cpu import dispatch
from service.engine.loader import LoadedModel, load_model

BINARY = Path(__file__).resolve().parents[1] / "build" / "llama.cpp" / "bin" / "llama-perplexity"
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")
BAR = 0.01  # issue 24: within 1% of llama.cpp's


def chunks_of(ids: list[int], ctx: int, bos: int | None, limit: int | None) -> list[list[int]]:
    """The text's whole chunks of `ctx` tokens, each opened by BOS (llama-perplexity's)."""
    count = len(ids) // ctx if limit is None else min(limit, len(ids) // ctx)
    chunks = [ids[i * ctx : (i + 1) * ctx] for i in range(count)]
    if bos is not None:
        chunks = [[bos, *chunk[1:]] for chunk in chunks]
    return chunks


@torch.inference_mode()
def ours(loaded: LoadedModel, chunks: list[list[int]]) -> tuple[float, int]:
    """Perplexity over every chunk's second half, and the number of tokens scored."""
    nll_sum, scored = 0.0, 0
    for chunk in chunks:
        ids = torch.tensor(chunk)
        first = len(chunk) // 2
        logits = window_logits(loaded, ids)  # [ctx, vocab]
        nll = F.cross_entropy(logits[first:-1], ids[first + 1 :], reduction="sum")
        nll_sum += float(nll)
        scored += len(chunk) - 1 - first
    return math.exp(nll_sum / scored), scored


def llama_cpp(
    binary: Path, model: Path, text: Path, ctx: int, chunks: int, threads: int
) -> tuple[float, float, int]:
    """llama-perplexity's final estimate (perplexity, its +/-) and how many chunks it ran."""
    command = [str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx),
               "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    log = done.stdout + done.stderr
    final, counted = _FINAL.search(log), _CHUNKS.search(log)
    if done.returncode or final is None or counted is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}):\n{log[-3000:]}")
    return float(final.group(1)), float(final.group(2)), int(counted.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=None, help="at most this many")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity -t")
    parser.add_argument("--llama-perplexity", type=Path, default=BINARY)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.llama_perplexity.is_file():
        print(f"no llama-perplexity at {args.llama_perplexity}: make llama-server builds it")
        return 2
    torch.set_num_threads(1)
    kernels = dispatch.select("auto")
    loaded = load_model(
        args.model, torch.float32, torch.device("cpu"), kernels=kernels, serve_stored=True
    )
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode_prompt(args.text.read_text(encoding="utf-8"))
    chunks = chunks_of(ids, args.ctx, tokenizer.bos_token_id if tokenizer.add_bos else None,
                       args.chunks)  # fmt: skip
    start = time.perf_counter()
    mine, scored = ours(loaded, chunks)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs, error, their_chunks = llama_cpp(
        args.llama_perplexity, args.model, args.text, args.ctx, len(chunks), args.threads
    )
    theirs_s = time.perf_counter() - start
    ratio = mine / theirs - 1
    print(
        f"llama_perplexity: {args.model.name} ({loaded.model.weights_name} as stored), "
        f"{args.text.name}, ctx {args.ctx}, on {dispatch.cpu_description()}"
    )
    print()
    print("| | tokens in the text | chunks | scored tokens | perplexity | time s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| pagechat (fp32 activations) | {len(ids)} | {len(chunks)} | {scored} | "
          f"{mine:.4f} | {ours_s:.1f} |")  # fmt: skip
    print(f"| llama-perplexity (-t {args.threads}) | | {their_chunks} | | "
          f"{theirs:.4f} +/- {error:.4f} | {theirs_s:.1f} |")  # fmt: skip
    print()
    met = abs(ratio) <= BAR
    print(f"pagechat / llama.cpp - 1 = {100 * ratio:+.3f}% (bar: within {100 * BAR:.0f}%): "
          f"{'met' if met else 'NOT met'}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model.name, "text": args.text.name, "ctx": args.ctx,
            "tokens": len(ids), "chunks": len(chunks), "scored": scored,
            "pagechat": mine, "llama_cpp": theirs, "llama_cpp_error": error,
            "llama_cpp_chunks": their_chunks, "ratio": ratio,
            "cpu": dispatch.cpu_description(),
        }, indent=1))  # fmt: skip
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
