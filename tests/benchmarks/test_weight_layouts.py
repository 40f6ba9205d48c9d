"""benchmarks/weight_layouts.py at a tiny scale: every type it names measured stored and
regrouped with the same outputs (it checks them itself), every row reported."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.weight_layouts import main


def test_each_type_is_measured_stored_and_regrouped_with_the_same_outputs(tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    argv = ["--mib", "1", "--repeats", "1", "--types", "Q4_0", "Q4_K", "Q6_K", "--cpu-isa",
            "auto", "generic", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["read_bandwidth_gbs"] > 0
    rows = report["rows"]
    assert [(r["isa"] == "generic", r["type"]) for r in rows][3:] == [
        (True, "Q4_0"), (True, "Q4_K"), (True, "Q6_K")
    ]  # fmt: skip
    assert all(r["stored"] > 0 and r["regrouped"] > 0 and r["rows"] % 8 == 0 for r in rows)
