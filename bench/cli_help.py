"""Print the cost of `kimictl --help` against `python -c "import typer, pydantic"` (target ratio <= 1.5)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def _median_seconds(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(runs: int = 15) -> None:
    py = sys.executable
    base = _median_seconds([py, "-c", "import typer, pydantic"], runs)
    cli = _median_seconds([py, "-m", "kimictl", "--help"], runs)
    print(f"import typer, pydantic: {base * 1000:.0f} ms (median of {runs})")
    print(f"kimictl --help:         {cli * 1000:.0f} ms (median of {runs})")
    print(f"ratio:                  {cli / base:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
