#!/usr/bin/env bash
# The device check (issue 35): on a machine with one GPU and no network, run
# tests/test_cuda.py and the benchmark's GPU rows (scripts/bench.py --device cuda) from
# this source tree, with the torch that machine has, and write everything into one
# directory. Sized to end in under 6 minutes on one H200 (each step has its own
# timeout); without a GPU it runs end to end all the same (test_cuda.py skips, the
# benchmark says "no GPU") and exits 0.
#
#   scripts/gpu_check.sh [OUTDIR]      (default: $OUT, else ./gpu_check_out)
#
# OUTDIR receives 8 files: versions.txt (Python, torch, CUDA, the GPU, asyncckpt),
# nvidia-smi.txt, pytest.log, pytest-junit.xml, bench.log (progress), bench.md and
# bench.json (the GPU rows; "partial": true where the time limit stopped the benchmark:
# what it finished is there), summary.txt (each step's exit status and seconds).
#
# Environment: PYTHON (default python3: the one that holds torch), GPU_CHECK_SIZE
# (full, the default; tiny: --quick's tiny states, for a smoke run), GPU_CHECK_WHEELS
# (the carried wheels, default .whl), GPU_CHECK_SITE (where they are installed,
# default /tmp/site), GPU_CHECK_BENCH_ARGS (more
# options for scripts/bench.py), GPU_CHECK_PYTEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT
# (seconds, default 60 / 290).
#
# Dependencies: the pure-Python ones (and isal's wheel) travel as wheels in .whl/ at the
# repository's root and are installed with --no-index --no-deps into GPU_CHECK_SITE;
# torch is the machine's own (torch 2.13 wheels with CUDA are too large to carry). On a
# machine with network access and pip, from the repository's root (ignored by git):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl isal==1.9.1 psutil==7.2.2 filelock==4.3.1 \
#     tqdm==4.70.1 safetensors==0.8.0 pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 \
#     iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
#
# (the versions CI tests; --python-version: the GPU machine's Python). Without .whl/
# the packages already installed are used.
set -u -o pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-${OUT:-./gpu_check_out}}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
py=${PYTHON:-python3}
size=${GPU_CHECK_SIZE:-full}
site=${GPU_CHECK_SITE:-/tmp/site}
summary=$out/summary.txt
: >"$summary"

step() { # step NAME SECONDS COMMAND...: run, record the exit status and the time
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "$name: exit $rc, $(($(date +%s) - t0)) s (limit $limit s)" >>"$summary"
    return $rc
}

cd "$repo" || exit 2
shopt -s nullglob
wheels=("${GPU_CHECK_WHEELS:-.whl}"/*.whl)
if ((${#wheels[@]})); then
    step "install ${#wheels[@]} wheels from ${GPU_CHECK_WHEELS:-.whl} into $site" 120 \
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}" || exit 1
    export PYTHONPATH=$repo:$site
else
    echo "no wheels in ${GPU_CHECK_WHEELS:-.whl}: the installed packages are used" >>"$summary"
    export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

{ nvidia-smi || echo "nvidia-smi: not found or failed (exit $?)"; } >"$out/nvidia-smi.txt" 2>&1
"$py" - >"$out/versions.txt" 2>&1 <<'EOF'
import platform, subprocess, sys
import torch
import asyncckpt
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"capability {p.major}.{p.minor}",
          "count", torch.cuda.device_count())
print("asyncckpt", asyncckpt.__version__, asyncckpt.__file__)
for name in ("isal", "psutil", "filelock", "tqdm", "safetensors", "pytest", "pytest_timeout"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"), mod.__file__)
    except ImportError as exc:
        print(name, "MISSING:", exc)
try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    print("git", head.stdout.strip() or head.stderr.strip())
except OSError as exc:
    print("git", exc)
EOF
echo "versions: exit $?" >>"$summary"

# pytest: only the plugins named here (the machine's own, e.g. pytest-cov, may not
# match the carried pytest).
step pytest "${GPU_CHECK_PYTEST_TIMEOUT:-60}" env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
    "$py" -m pytest -p pytest_timeout -p no:cacheprovider -q -rA tests/test_cuda.py \
    --junitxml="$out/pytest-junit.xml" 2>&1 | tee "$out/pytest.log"
pytest_rc=${PIPESTATUS[0]}

if [ "$size" = tiny ]; then
    size_args=(--quick)
else # issue 35's GPU loop at K = 4 and 10 (measured first; K = 1, disk-bound for every system, is
    # left to the full benchmark) and the llm state, fewer repetitions than the full benchmark's;
    # no export. About 280 s of benchmark on the H200 machine (2026-11-28).
    size_args=(--train-every 4,10 --train-steps 20 --train-min-checkpoints 4 --train-reps 1
        --llm-reps 2 --load-reps 1 --export-reps 0)
fi
# shellcheck disable=SC2086 # GPU_CHECK_BENCH_ARGS: options, split on spaces
step bench "${GPU_CHECK_BENCH_TIMEOUT:-290}" "$py" scripts/bench.py --device cuda "${size_args[@]}" \
    --share-dcp-daemon --json "$out/bench.json" --md "$out/bench.md" --png '' ${GPU_CHECK_BENCH_ARGS:-} \
    >/dev/null 2>"$out/bench.log"
bench_rc=$?
tail -n 3 "$out/bench.log"

echo "gpu_check: pytest exit $pytest_rc, bench exit $bench_rc; results in $out" | tee -a "$summary"
[ "$pytest_rc" = 0 ] && [ "$bench_rc" = 0 ]
