#!/usr/bin/env bash
# Download, on a machine that reaches the package registry, the wheels that tools/gpu_check.sh
# installs offline on the GPU machine (Linux x86_64, Python 3.12 by default, its own CUDA torch).
#
#   tools/prepare_gpu_wheels.sh [DIR]        DIR defaults to .gpu_wheels (git-ignored)
#
# What: megatron-core, transformers, safetensors, pyyaml, psutil, tqdm, numpy, packaging at the
# versions rltrain/requirements.py pins, plus pytest, and everything they depend on, as binary
# wheels for the GPU machine's Python (GPU_PYTHON_VERSION, default 3.12), except torch and its CUDA
# parts (CUDA libraries, triton): the GPU machine's own CUDA torch is used.
# Writes DIR/requirements.txt (what gpu_check.sh installs) and DIR/MANIFEST.txt (file, bytes,
# sha256), prints the list and the total, and fails above GPU_WHEELS_LIMIT_MIB (default 60: the
# device tool carries at most 64 MiB of ignored paths in all).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/.gpu_wheels}
PY=${PYTHON:-$ROOT/.venv/bin/python}
PYVER=${GPU_PYTHON_VERSION:-3.12}
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-60}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
TARGET=(--python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" --only-binary=:all:)

[ -x "$PY" ] || { echo "prepare_gpu_wheels: no python at $PY (set PYTHON=...)" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The top-level requirements, with rltrain's pins.
"$PY" - "$ROOT" > "$WORK/requirements.txt" <<'EOF'
import runpy, sys
from packaging.requirements import Requirement

req = runpy.run_path(f"{sys.argv[1]}/rltrain/requirements.py")
wanted = ["megatron-core", "transformers", "safetensors", "pyyaml", "psutil", "tqdm", "numpy", "packaging"]
pins = {Requirement(r).name.lower(): r for r in req["CORE"]}
missing = [w for w in wanted if w not in pins]
if missing:
    sys.exit(f"prepare_gpu_wheels: rltrain/requirements.py CORE has no pin for {missing}")
print("\n".join([pins[w] for w in wanted] + [r for r in req["EXTRAS"]["dev"] if r.startswith("pytest")]))
EOF
echo "requirements (from rltrain/requirements.py):"; sed 's/^/  /' "$WORK/requirements.txt"

# Resolve the whole tree for the GPU machine's Python (metadata only: nothing is installed).
"$PY" -m pip install --quiet --dry-run --ignore-installed --target "$WORK/never" "${TARGET[@]}" \
    --report "$WORK/report.json" -r "$WORK/requirements.txt"

# Keep everything but torch itself and its CUDA parts (the GPU machine's own build has them). torch's
# small pure dependencies (sympy, networkx, jinja2, setuptools, ...) are kept: pip checks that the
# installed torch's requirements hold, and installs one of them only where it is missing.
"$PY" - "$WORK/report.json" "$WORK/requirements.txt" "$PYVER" > "$WORK/pins.txt" <<'EOF'
import json, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

report, top_file, pyver = sys.argv[1:]
env = {"python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
packages = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in json.load(open(report))["install"]}

def deps(meta):
    for text in meta.get("requires_dist") or []:
        r = Requirement(text)
        if r.marker is None or r.marker.evaluate(env):
            yield canonicalize_name(r.name)

def cuda_part(name):
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))

todo = [canonicalize_name(Requirement(line.strip()).name) for line in open(top_file) if line.strip()]
todo.append("torch")
keep, seen = set(), set()
while todo:
    name = todo.pop()
    if name in seen:
        continue
    seen.add(name)
    if not cuda_part(name):
        keep.add(name)
    todo.extend(d for d in deps(packages[name]) if d in packages)
for name in sorted(keep):
    print(f"{name}=={packages[name]['version']}")
skipped = sorted(set(packages) - keep)
print(f"left to the GPU machine's own CUDA torch: {', '.join(skipped)}", file=sys.stderr)
EOF

rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DIR" -r "$WORK/pins.txt"
cp "$WORK/requirements.txt" "$DIR/requirements.txt"
(cd "$DIR" && for f in *.whl; do printf '%s %s %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-64)"; done) \
    > "$DIR/MANIFEST.txt"

echo "downloaded into $DIR:"
awk '{ printf "  %-90s %7.2f MiB\n", $1, $2 / 1048576; total += $2 } END { printf "  total %.2f MiB in %d wheels\n", total / 1048576, NR }' \
    "$DIR/MANIFEST.txt"
total=$(du -sb "$DIR" | cut -f1)
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "prepare_gpu_wheels: $DIR holds $((total / 1048576)) MiB, above $LIMIT_MIB MiB" >&2
    exit 1
fi
echo "carry it to the GPU machine with the working tree: the device tool's carry: [\"${DIR#"$ROOT"/}\"]"
