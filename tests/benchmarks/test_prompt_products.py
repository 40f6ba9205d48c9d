"""benchmarks/prompt_products.py at a tiny scale: each type timed on each version named, in
order (it checks each row against its one-row product and the versions against the first
itself), every row reported."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.prompt_products import main


def test_each_type_is_timed_on_each_version_and_checked(tmp_path: Path) -> None:
    out = tmp_path / "prompt_products.json"
    argv = ["--rows", "40", "--n", "40", "--k", "512", "--repeats", "1", "--types", "Q4_0",
            "Q6_K", "--cpu-isa", "generic", "avx2", "auto", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["type"], r["isa"]) for r in results][:2] == [("Q4_0", "generic"), ("Q4_0", "avx2")]
    assert [r["type"] for r in results] == ["Q4_0"] * 3 + ["Q6_K"] * 3
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in results)
    assert all(r["ratio"] == 1.0 for r in results if r["isa"] == "generic")
