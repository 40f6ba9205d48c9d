"""llguidance against xgrammar on this CPU: what a JSON Schema costs to compile and what a
token mask costs per step, on a real model's vocabulary.

For each of `--schemas` random schemas (benchmarks/json_schemas.py) and each library: the time
to compile the schema and make a matcher, then a walk through a valid instance of the schema,
token by token (the model's own tokenization of the compact JSON), filling the vocabulary's
bitmask before each token and consuming it after. Both libraries must accept every instance;
a token one of them refuses is reported. Times are medians and 95th percentiles over all
schemas (compile) and all steps (mask).

xgrammar is not a dependency of pagechat (service/engine/grammar.py uses llguidance); install
it beside to re-run the comparison: `.venv/bin/pip install xgrammar==0.2.8`.

    .venv/bin/python -m benchmarks.grammar_backends [--model gemma] [--schemas 100]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

from benchmarks.json_schemas import random_instance, schemas
from benchmarks.output import emit
from service.engine.grammar import JSON_OPTIONS
from service.engine.tokenizer import Tokenizer


def load_tokenizer(which: str) -> Tokenizer:
    from service.engine.loader import default_model_path, gguf_tokenizer, open_gguf

    if which == "gemma":
        from benchmarks.kv_window_bytes import gemma3_270m

        path = gemma3_270m()
    else:
        path = default_model_path()
    return gguf_tokenizer(open_gguf(path))


class Backend(Protocol):
    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None: ...
    def consume(self, matcher: Any, token: int) -> bool: ...


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance

        self._llg = llguidance
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_json(),
            n_vocab=tokenizer.vocab_size,
            eos_token=list(tokenizer.eos_token_ids),
        )
        self.setup_s = time.perf_counter() - start

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        # as the service fills a row (llguidance.torch's helper would torch.compile at import)
        row = bitmask[0]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import tokenizers
        import transformers

        with warnings.catch_warnings():  # its own torch.jit use, deprecated by torch 2.13
            warnings.simplefilter("ignore", DeprecationWarning)
            import xgrammar

        self._xgr = xgrammar
        start = time.perf_counter()
        backend = tokenizers.Tokenizer.from_str(tokenizer.backend_json())
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)  # type: ignore[no-untyped-call]
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=tokenizer.vocab_size, stop_token_ids=list(tokenizer.eos_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - start

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self._compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def measure(
    backend: Backend, cases: list[tuple[dict[str, Any], list[int]]], vocab: int
) -> dict[str, Any]:
    compile_s: list[float] = []
    mask_s: list[float] = []
    left_out = refused = 0
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    for schema, tokens in cases:
        start = time.perf_counter()
        matcher = backend.compile(schema)
        compile_s.append(time.perf_counter() - start)
        for token in tokens:
            start = time.perf_counter()
            backend.fill(matcher, bitmask)
            mask_s.append(time.perf_counter() - start)
            # A token the mask leaves out that the matcher accepts: the instance can still be
            # written, in another tokenization; one the matcher refuses: it cannot.
            left_out += not bool((bitmask[0, token // 32] >> (token % 32)) & 1)
            if not backend.consume(matcher, token):
                refused += 1
                break
    return {
        "backend": backend.name,
        "setup_s": round(getattr(backend, "setup_s", 0.0), 3),
        "compile_ms_median": round(1e3 * statistics.median(compile_s), 3),
        "compile_ms_p95": round(1e3 * _p95(compile_s), 3),
        "mask_us_median": round(1e6 * statistics.median(mask_s), 1),
        "mask_us_p95": round(1e6 * _p95(mask_s), 1),
        "steps": len(mask_s),
        "instances_refused": refused,
        "tokens_left_out_of_the_mask": left_out,
    }


def _p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * (len(values) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "gemma"], default="smollm2")
    parser.add_argument("--schemas", type=int, default=100)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    rng = random.Random(7)
    cases = []
    for schema in schemas(args.schemas, seed=11):
        text = json.dumps(random_instance(schema, rng))  # the separators both are told
        cases.append((schema, [*tokenizer.encode(text), tokenizer.eos_token_ids[0]]))
    makers: list[Callable[[Tokenizer], Backend]] = [LLGuidance, XGrammar]
    results = []
    for make in makers:
        try:
            backend = make(tokenizer)
        except ImportError as error:
            print(f"{make.__name__}: not installed ({error})", file=sys.stderr)
            continue
        measure(backend, cases[:3], tokenizer.vocab_size)  # warm-up
        results.append(measure(backend, cases, tokenizer.vocab_size))
    report = {
        "model": args.model,
        "vocab": tokenizer.vocab_size,
        "schemas": args.schemas,
        "cpu": platform.processor() or platform.machine(),
        "results": results,
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
