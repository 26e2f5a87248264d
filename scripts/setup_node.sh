#!/usr/bin/env bash
# Installs on a GPU node what its image lacks, keeping the image's torch (workload.yaml runs it on every node):
#   1. the pinned packages of requirements.txt (all but torch);
#   2. hybrid models: flash-linear-attention, and on Hopper (sm_90) with Triton < 3.7.1 also tilelang: there
#      fla refuses its Triton kernel for the Gated DeltaNet backward (fla #640: wrong gradients) and uses a
#      TileLang kernel instead, which it compiles with the node's nvcc on first use;
#   3. hybrid models: causal-conv1d, compiled against the image's torch for this node's GPU only.
#
#   bash scripts/setup_node.sh            # a hybrid model (qwen3_5): 1-3
#   bash scripts/setup_node.sh --dense    # a dense model (Llama, Qwen3): 1 only
#
# causal-conv1d's own setup.py compiles for nine GPU architectures (15+ minutes); restricted to this node's it
# takes about 6 minutes on an H200 node, once: the wheel is kept in $WHEEL_CACHE (a Unity Catalog volume in
# practice), keyed by version, torch, CUDA, Python and architecture, and later runs and retries install it in
# seconds.
#
# NODE_SETUP_DRY_RUN=1 runs everything up to the CUDA compile and changes nothing: the build-tool check, the
# installs as `pip install --dry-run`, the causal-conv1d download and the architecture patch (the tests run it
# this way on CPU). GPU_ARCH=90 (or 100, 103, ...) stands for the query of the GPU, on a machine without one.
set -euo pipefail
cd "$(dirname "$0")/.."
CAUSAL_CONV1D=1.7.0
FLA=0.6.0
TILELANG=0.1.15
dense=0
case "${1:-}" in
  --dense) dense=1 ;;
  "") ;;
  *) echo "usage: bash scripts/setup_node.sh [--dense]" >&2; exit 2 ;;
esac
dry=()
[ "${NODE_SETUP_DRY_RUN:-0}" = 1 ] && dry=(--dry-run)
pins=$(grep -Ev '^(#|torch==|$)' requirements.txt)
if [ "$dense" = 1 ]; then
  python -m pip install "${dry[@]}" --no-cache-dir $pins
  [ ${#dry[@]} -gt 0 ] && echo "dry run: the pinned packages resolve; nothing installed"
  exit 0
fi

# What this node is: the cache key of its causal-conv1d build, its GPU architecture, and whether fla needs tilelang.
node=$(python - <<'PY'
import importlib.metadata, os, sys, torch
from packaging.version import Version

if os.environ.get("GPU_ARCH"):
    arch = os.environ["GPU_ARCH"]
elif torch.cuda.is_available():
    arch = "%d%d" % torch.cuda.get_device_capability()
else:
    sys.exit("setup_node.sh: no CUDA GPU visible to torch; set GPU_ARCH (90 for H100/H200, 100 B200, 103 B300)")
try:
    triton = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    triton = "0"
tilelang = arch == "90" and Version(triton) < Version("3.7.1")
key = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}-sm{arch}"
print(key, arch, int(tilelang), torch.version.cuda or "none")
PY
)
read -r key arch needs_tilelang torch_cuda <<<"$node"
cache="${WHEEL_CACHE:-/tmp/wheel-cache}/causal-conv1d-$CAUSAL_CONV1D-$key"
build=1
ls "$cache"/*.whl >/dev/null 2>&1 && build=0

# The build's tools, checked before anything is installed: a missing one would otherwise show up minutes later.
if [ "$build" = 1 ]; then
  missing=()
  nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  [ -x "$nvcc" ] || nvcc=$(command -v nvcc || true)
  if [ -z "$nvcc" ]; then
    missing+=("nvcc (the CUDA compiler: use an image with the CUDA toolkit, or set CUDA_HOME)")
  else
    nvcc_cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
    if [ "$torch_cuda" != none ] && [ "${nvcc_cuda%%.*}" != "${torch_cuda%%.*}" ]; then
      missing+=("nvcc of CUDA ${torch_cuda%%.*} (found $nvcc_cuda at $nvcc; torch is built with CUDA $torch_cuda)")
    fi
  fi
  for module in setuptools wheel packaging; do
    python -c "import $module" 2>/dev/null || missing+=("the Python package $module (pip install $module)")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    printf 'setup_node.sh: building causal-conv1d needs:\n' >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 1
  fi
  command -v ninja >/dev/null || echo "setup_node.sh: warning: no ninja, the causal-conv1d build runs one file at a time"
fi

extra=("flash-linear-attention==$FLA")
[ "$needs_tilelang" = 1 ] && extra+=("tilelang==$TILELANG")
python -m pip install "${dry[@]}" --no-cache-dir $pins "${extra[@]}"

if [ "$build" = 1 ]; then
  echo "building causal-conv1d $CAUSAL_CONV1D for sm_$arch into $cache (once per torch, CUDA, Python and GPU)"
  work=$(mktemp -d)
  # The sdist only (its build needs this torch, so no isolated build environment); reading its metadata runs
  # setup.py, which without SKIP_CUDA_BUILD would need nvcc just to name the package.
  CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE python -m pip download -q --no-deps --no-build-isolation \
    --no-binary causal-conv1d "causal-conv1d==$CAUSAL_CONV1D" -d "$work"
  tar xzf "$work/causal_conv1d-$CAUSAL_CONV1D.tar.gz" -C "$work"
  src="$work/causal_conv1d-$CAUSAL_CONV1D"
  # Replace the nine -gencode pairs its setup.py appends with this node's one, just before they are used.
  cp "$src/setup.py" "$src/setup.py.orig"
  ARCH="$arch" python - "$src/setup.py" <<'PY'
import os, sys

path, arch = sys.argv[1], os.environ["ARCH"]
marker = "    # HACK: The compiler flag"
text = open(path).read()
assert text.count(marker) == 1, "causal-conv1d's setup.py changed: update scripts/setup_node.sh"
only_this_gpu = (
    "    cc_flag = [f for f in cc_flag if f != '-gencode' and not f.startswith('arch=')]"
    f" + ['-gencode', 'arch=compute_{arch},code=sm_{arch}']\n"
)
open(path, "w").write(text.replace(marker, only_this_gpu + marker))
PY
  if [ ${#dry[@]} -gt 0 ]; then
    echo "dry run: would compile $src for sm_$arch and install it; stopping before the compile"
    exit 0
  fi
  t0=$SECONDS
  CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="$(nproc)" python -m pip wheel -q --no-build-isolation --no-deps \
    -w "$work/wheel" "$src"
  echo "built causal-conv1d in $((SECONDS - t0)) s"
  mkdir -p "$cache.tmp.$$" && cp "$work"/wheel/*.whl "$cache.tmp.$$"/ && mv -T "$cache.tmp.$$" "$cache" \
    || rm -rf "$cache.tmp.$$"  # another node finished the same build first
  rm -rf "$work"
elif [ ${#dry[@]} -gt 0 ]; then
  echo "dry run: would install the cached $(ls "$cache"/*.whl)"
  exit 0
fi
python -m pip install --no-deps --force-reinstall "$cache"/*.whl
python -c "import torch, causal_conv1d, fla; print('causal-conv1d', causal_conv1d.__version__, '| fla', fla.__version__)"
if [ "$needs_tilelang" = 1 ]; then
  python -c "import tilelang; print('tilelang', tilelang.__version__, '(fla runs the Gated DeltaNet backward with it)')"
fi
