"""The benchmark still runs end to end (its --quick smoke mode); figures are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_bench_quick_runs_and_reports_every_system(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=220,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| asyncckpt persistent (async) |" in proc.stdout
    result = json.loads(out.read_text())["results"][0]
    assert result["bytes"] > 0 and result["memcpy_s"] > 0 and result["raw_write_fsync_s"] > 0
    assert set(result["systems"]) == {
        "torch.save (sync)", "dcp.save (sync)", "asyncckpt (sync)",
        "asyncckpt temporal (async)", "asyncckpt persistent (async)",
    }
    for figures in result["systems"].values():
        assert figures["stall_s"] > 0 and figures["committed_s"] >= figures["stall_s"]
    assert not list(tmp_path.glob("bench_*")), "the benchmark must remove its scratch directory"
