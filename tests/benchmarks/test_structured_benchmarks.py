"""The structured-output benchmarks at a tiny size: they run, both libraries accept every
instance, and the throughput run times full batches (no answer ends inside its steps)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from benchmarks import grammar_backends, sampler, structured_throughput
from benchmarks.json_schemas import random_instance, schemas

pytestmark = pytest.mark.real_model


def test_every_generated_instance_validates_against_its_schema() -> None:
    rng = random.Random(3)
    for schema in schemas(200, seed=5):
        for _ in range(3):
            jsonschema.validate(random_instance(schema, rng), schema)


def test_both_grammar_libraries_accept_every_instance(tmp_path: Path) -> None:
    out = tmp_path / "backends.json"
    assert grammar_backends.main(["--schemas", "8", "--json", str(out)]) == 0
    results = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"llguidance", "xgrammar"}
    for r in results.values():
        assert r["instances_refused"] == 0 and r["steps"] > 0, r


def test_the_throughput_run_times_full_batches_with_and_without_a_schema(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    args = ["--batch", "2", "--steps", "3", "--repeats", "1", "--json", str(out)]
    assert structured_throughput.main(args) == 0
    (row,) = json.loads(out.read_text())["batches"]
    assert row["schema_tokens_per_s"] > 0 and row["free_tokens_per_s"] > 0
    assert row["schema_phases"]["grammar_ms"] > 0  # the masks were filled
    assert row["ratio_same_forward"] > 0


def test_the_same_forward_ratio_keeps_only_what_differs_besides_the_forward() -> None:
    schema = {"forward_ms": 80.0, "grammar_ms": 3.0, "sample_ms": 2.0, "tokens_per_s": 1.0}
    free = {"forward_ms": 60.0, "grammar_ms": 0.0, "sample_ms": 5.0, "tokens_per_s": 1.0}
    # both at a 70 ms forward: 75 ms a step free, 75 ms with the schema
    assert structured_throughput.same_forward_ratio(schema, free) == 1.0
    schema["grammar_ms"] = 13.0
    assert structured_throughput.same_forward_ratio(schema, free) == 75 / 85


def test_the_sampler_benchmark_times_every_case_on_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "sampler.json"
    args = ["--rows", "3", "--vocab", "1000", "--context", "50", "--repeats", "2"]
    assert sampler.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())["ms_per_step"]
    assert len(report) == 2  # the tensor ops and the CPU kernels
    for figures in report.values():
        assert set(figures) == {"seeded", "dense grammar", "sparse grammar", "greedy", "penalties"}
        assert all(ms > 0 for ms in figures.values())
