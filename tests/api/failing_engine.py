"""`pagechat serve` whose engine step raises once it has run a given number of steps: a real
server process with one injected fault, to see what a dead engine does to the service.

    python -m tests.api.failing_engine STEPS serve [options]
"""

from __future__ import annotations

import sys

from service import cli
from service.engine.engine import LLMEngine
from service.engine.values import RequestOutput


class InjectedFault(RuntimeError):
    pass


def main() -> int:
    fail_after = int(sys.argv[1])
    step = LLMEngine.step

    def failing_step(self: LLMEngine) -> list[RequestOutput]:
        if self.stats().steps >= fail_after:
            raise InjectedFault(f"injected after {fail_after} steps")
        return step(self)

    LLMEngine.step = failing_step  # type: ignore[method-assign]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
