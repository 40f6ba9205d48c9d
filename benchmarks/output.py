"""How a benchmark hands back its figures: the report as JSON on stdout, and in a file where
`--json` names one."""

from __future__ import annotations

import json
from typing import Any


def emit(report: dict[str, Any], json_path: str | None) -> None:
    print(json.dumps(report, indent=2))
    if json_path:
        with open(json_path, "w") as out:
            json.dump(report, out, indent=2)
