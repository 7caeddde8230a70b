"""scripts/gpu_check.sh, the device check of issue 35, runs end to end on any machine:
it installs the carried wheels, runs tests/test_cuda.py and the benchmark's GPU rows,
and writes every result into its output directory. Here (CI has no GPU) test_cuda.py
skips and the benchmark says "no GPU"; on a GPU the same files hold the measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "versions.txt",
    "nvidia-smi.txt",
    "pytest.log",
    "pytest-junit.xml",
    "bench.log",
    "bench.md",
    "bench.json",
    "summary.txt",
}


def _probe_wheel(directory: Path) -> Path:
    """A pure-Python wheel of one module (what the script's offline install takes)."""
    name, version = "gpu_check_probe", "1.0"
    dist = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{name}.py": "VALUE = 35\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a GPU (on a GPU it measures)")
def test_gpu_check_runs_end_to_end_without_a_gpu(tmp_path: Path) -> None:
    wheels, site, out = tmp_path / "whl", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    _probe_wheel(wheels)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_SIZE": "tiny",
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_SITE": str(site),
    }
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == FILES  # 8 files: what the device tool brings back

    # The carried wheels were installed, offline, where the script put them on the path.
    assert (site / "gpu_check_probe.py").read_text() == "VALUE = 35\n"
    summary = (out / "summary.txt").read_text()
    assert "install 1 wheels" in summary and "pytest: exit 0" in summary and "bench: exit 0" in summary

    versions = (out / "versions.txt").read_text()
    assert f"torch {torch.__version__} " in versions and "available False" in versions
    assert f"asyncckpt 0.1.0 {ROOT / 'asyncckpt' / '__init__.py'}" in versions  # the source tree's
    assert "MISSING" not in versions

    # tests/test_cuda.py ran, every test skipped for want of a device.
    suite = ET.parse(out / "pytest-junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    assert int(suite.get("tests", 0)) >= 2
    assert int(suite.get("skipped", 0)) == int(suite.get("tests", 0))
    assert int(suite.get("failures", 0)) == int(suite.get("errors", 0)) == 0
    assert "needs a CUDA device" in (out / "pytest.log").read_text()

    # The benchmark's GPU rows say why they were not measured.
    res = json.loads((out / "bench.json").read_text())
    assert res["device"] == "cuda" and res["no_gpu"].startswith("no GPU") and res["workloads"] == []
    assert res["args"]["quick"] is True
    assert "no GPU" in (out / "bench.md").read_text()
    assert "no GPU" in (out / "bench.log").read_text()
