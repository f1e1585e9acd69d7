#!/usr/bin/env bash
# The GPU check: one command on a machine with a CUDA device and no network, done in 8 minutes.
#
#   tools/gpu_check.sh [WHEELS_DIR]      WHEELS_DIR: what tools/prepare_gpu_wheels.sh downloaded
#                                        (default .gpu_wheels)
# 1. Prints the machine: nvidia-smi -L, Python, torch and its CUDA, glibc.
# 2. Makes a venv over the machine's Python with --system-site-packages (its own CUDA torch stays in
#    use) at $GPU_VENV (default /tmp/rltrain-gpu-venv) and installs what is missing from WHEELS_DIR
#    only (pip --no-index: no network is ever reached).
# 3. Runs every test marked gpu (in the files under tests/ that use the marker) under a hard timeout,
#    then bench/weight_sync_gpu.py; the whole check stays within GPU_CHECK_BUDGET_S (default 480).
# 4. Prints a summary. Exit code 0 only when every step passed and no gpu test was skipped (on a
#    GPU machine nothing may skip; GPU_CHECK_ALLOW_SKIPS=1 allows it).
# GPU_CHECK_ONLY=SUBSTRING runs only the gpu test files whose path holds it and no bench, for a quick
# rerun after a fix; the summary then says PARTIAL, never PASS.
# Logs and the tests' junit xml go to $OUT/gpu_check when $OUT is set (the device tool brings $OUT
# back), else to /tmp/rltrain-gpu-check.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
WHEELS=$(realpath -m "${1:-$ROOT/.gpu_wheels}")
VENV=${GPU_VENV:-/tmp/rltrain-gpu-venv}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
BENCH_RESERVE=75
LOGS=${OUT:-/tmp/rltrain-gpu-check}/gpu_check
mkdir -p "$LOGS"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$SECONDS
declare -A STATUS
fail() { echo "gpu_check: $*" >&2; exit 1; }
left() { echo $((BUDGET - (SECONDS - START))); }

echo "==== machine"
nvidia-smi -L || fail "nvidia-smi -L failed: no NVIDIA driver or device here"
PY=${GPU_PYTHON:-}
if [ -z "$PY" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" > /dev/null && "$candidate" -c "import torch" 2> /dev/null; then
            PY=$candidate
            break
        fi
    done
fi
[ -n "$PY" ] || fail "no python3/python with torch on PATH (set GPU_PYTHON=/path/to/python)"
"$PY" - << 'EOF' || fail "the machine's torch sees no CUDA device"
import platform, sys, torch
print(f"python {sys.version.split()[0]} ({sys.executable}); glibc {platform.libc_ver()[1]}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
if not torch.cuda.is_available():
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
EOF

echo "==== install (offline, from $WHEELS)"
[ -f "$WHEELS/requirements.txt" ] || fail "no $WHEELS/requirements.txt: run tools/prepare_gpu_wheels.sh where the registry is reachable and carry the folder here"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV" 2> "$LOGS/venv.log" ||
        { rm -rf "$VENV" && "$PY" -m venv --system-site-packages --without-pip "$VENV"; } ||
        fail "could not create a venv at $VENV (see $LOGS/venv.log)"
fi
VPY=$VENV/bin/python
# When the machine's Python is itself a venv (torch under /opt/torch/.venv, say),
# --system-site-packages reaches only the base interpreter's packages: a .pth file puts the machine
# venv's own site-packages (its CUDA torch) on the new venv's path, where pip sees it as installed.
"$PY" -c "import sys, sysconfig; sys.prefix != sys.base_prefix and print('\n'.join(dict.fromkeys(sysconfig.get_paths()[k] for k in ('purelib', 'platlib'))))" \
    > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_machine_python.pth" ||
    fail "could not link the machine Python's site-packages into $VENV"
if "$VPY" -m pip --version > /dev/null 2>&1; then
    PIP=("$VPY" -m pip)
else
    PIP=("$PY" -m pip --python "$VPY")  # a venv without pip (no ensurepip): the machine's pip installs into it
fi
if timeout 120 "${PIP[@]}" install --no-index --only-binary=:all: --find-links "$WHEELS" \
    -r "$WHEELS/requirements.txt" > "$LOGS/pip.log" 2>&1; then
    STATUS[install]="ok ($(grep -c '' "$WHEELS/requirements.txt") requirements; $(grep -E '^Successfully installed' "$LOGS/pip.log" | wc -w | awk '{print ($1 > 2 ? $1 - 2 : 0)}') packages installed, the rest already there)"
else
    tail -20 "$LOGS/pip.log"
    fail "offline install failed (log: $LOGS/pip.log)"
fi
"$VPY" - << 'EOF' || fail "the installed packages do not import (see above)"
import importlib.util, warnings
warnings.simplefilter("ignore")
import megatron.core, safetensors, torch, transformers
te = importlib.util.find_spec("transformer_engine") is not None
tr = importlib.util.find_spec("triton") is not None
print(f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}, "
      f"safetensors {safetensors.__version__}; transformer_engine {'installed' if te else 'absent (local layer spec)'}; "
      f"triton {'installed' if tr else 'absent'}; torch {torch.__version__} from {torch.__file__}")
EOF
echo "install: ${STATUS[install]}"

echo "==== gpu tests"
# Test files that use the marker: directly (pytest.mark.gpu) or through tests/gpu/gpu_env.gpu_only.
mapfile -t FILES < <(grep -rlE "mark\.gpu\b|gpu_only\(" tests --include='test_*.py' | grep -F -- "${GPU_CHECK_ONLY:-}" | sort)
[ "${#FILES[@]}" -gt 0 ] || fail "no test file under tests/ uses the gpu marker${GPU_CHECK_ONLY:+ and matches GPU_CHECK_ONLY=$GPU_CHECK_ONLY}"
printf '  %s\n' "${FILES[@]}"
T_TESTS=$(($(left) - BENCH_RESERVE))
[ "$T_TESTS" -gt 60 ] || fail "only $(left) s of the ${BUDGET} s budget left before the tests"
timeout --kill-after=10 "$T_TESTS" "$VPY" -m pytest -p no:cacheprovider -m gpu -rA -q \
    --junitxml="$LOGS/gpu_tests.xml" "${FILES[@]}" 2>&1 | tee "$LOGS/pytest.log"
RC=${PIPESTATUS[0]}
COUNTS=$("$VPY" - "$LOGS/gpu_tests.xml" << 'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0 0"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(total["tests"], total["failures"], total["errors"], total["skipped"])
EOF
)
read -r N_TESTS N_FAIL N_ERR N_SKIP <<< "$COUNTS"
if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
    STATUS[tests]="FAIL: timed out after ${T_TESTS} s"
elif [ "$RC" -ne 0 ]; then
    STATUS[tests]="FAIL: pytest exit $RC ($N_TESTS tests, $N_FAIL failed, $N_ERR errors, $N_SKIP skipped)"
elif [ "$N_SKIP" -gt 0 ] && [ "${GPU_CHECK_ALLOW_SKIPS:-0}" != 1 ]; then
    STATUS[tests]="FAIL: $N_SKIP of $N_TESTS gpu tests skipped on a GPU machine (reasons above; GPU_CHECK_ALLOW_SKIPS=1 allows it)"
else
    STATUS[tests]="ok ($N_TESTS tests, $N_SKIP skipped)"
fi

echo "==== bench/weight_sync_gpu.py"
T_BENCH=$(($(left) - 5))
if [ -n "${GPU_CHECK_ONLY:-}" ]; then
    STATUS[bench]="skipped (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
elif [ "$T_BENCH" -lt 20 ]; then
    STATUS[bench]="FAIL: not run, only $(left) s of the budget left"
else
    timeout --kill-after=10 "$T_BENCH" "$VPY" bench/weight_sync_gpu.py --repeats 20 2>&1 | tee "$LOGS/bench.log"
    RC=${PIPESTATUS[0]}
    if [ "$RC" -eq 0 ]; then
        STATUS[bench]="ok: $(grep -E '^ratio ipc hand-off / d2d copy' "$LOGS/bench.log" | head -1)"
    elif [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
        STATUS[bench]="FAIL: timed out after ${T_BENCH} s"
    else
        STATUS[bench]="FAIL: exit $RC (log: $LOGS/bench.log)"
    fi
fi

echo "==== GPU check summary ($((SECONDS - START)) s of ${BUDGET} s; logs in $LOGS)"
nvidia-smi -L | head -1
RESULT=PASS
for step in install tests bench; do
    echo "  $step: ${STATUS[$step]}"
    [[ ${STATUS[$step]} == ok* || ${STATUS[$step]} == skipped* ]] || RESULT=FAIL
done
[ "$RESULT" = PASS ] && [ -n "${GPU_CHECK_ONLY:-}" ] && RESULT="PARTIAL (only the gpu tests matching GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
grep -hE "^(device|layer spec|bfloat16 vs|float32 vs|grad norm|d2d|ipc hand-off|bit-exact|NOT bit-exact)" \
    "$LOGS/pytest.log" "$LOGS/bench.log" 2> /dev/null | sed 's/^/  /' | cut -c1-220
echo "GPU CHECK: $RESULT"
[ "$RESULT" = PASS ] || [[ $RESULT == PARTIAL* ]]
