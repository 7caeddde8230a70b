"""Side-by-side checkpoint benchmark: asyncckpt against torch.save, DCP and the physical limits.

The command; the benchmark itself is the package scripts/benchmark/ (``--help`` and its
docstring say what it measures).

    python scripts/bench.py --quick               # smoke run (< 60 s)
    python scripts/bench.py --md bench_full.md    # everything (about 25-30 min here)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the benchmark package
from benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="bench.py"))
