"""The node-local tier's benchmark rows (issue 31): see scripts/benchmark/local_tier.py.

python scripts/bench_local_tier.py --mb 64
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the benchmark package
from benchmark.local_tier import main

if __name__ == "__main__":
    sys.exit(main())
