"""Object storage benchmark (issue 32): asyncckpt's S3 tier against raw boto3 on the
same server; the rows are the package module ``scripts/benchmark/objstore.py`` (see
its docstring, or ``--help``).

    python scripts/bench_s3.py                       # 1 GiB in 4096 tensors; K = 4, 16
    python scripts/bench_s3.py --mib 256 --tensors 1024 --no-train
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the benchmark package
from benchmark.objstore import main

if __name__ == "__main__":
    raise SystemExit(main())
