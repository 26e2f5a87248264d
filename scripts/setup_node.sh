#!/usr/bin/env bash
# Installs on a GPU node what its image lacks, keeping the image's torch: the pinned packages of
# requirements.txt, flash-linear-attention, and causal-conv1d compiled against the image's torch.
#
# causal-conv1d takes many minutes to compile, so its wheel is built once per (version, torch, CUDA, Python,
# GPU architecture) into $WHEEL_CACHE (a Unity Catalog volume in practice) and installed from there on later
# runs and retries. Its setup.py ignores TORCH_CUDA_ARCH_LIST and compiles for nine architectures (15+
# minutes on an H200 node); the build here is restricted to this node's architecture (about 6 minutes for
# sm_90).
set -euo pipefail
cd "$(dirname "$0")/.."
CAUSAL_CONV1D=1.7.0
FLA=0.6.0

python -m pip install --no-cache-dir $(grep -Ev '^(#|torch==|$)' requirements.txt) "flash-linear-attention==$FLA"

read -r key arch < <(python -c '
import sys, torch
major, minor = torch.cuda.get_device_capability()
print(f"torch{torch.__version__.split(\"+\")[0]}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}-sm{major}{minor}", f"{major}{minor}")')
cache="${WHEEL_CACHE:-/tmp/wheel-cache}/causal-conv1d-$CAUSAL_CONV1D-$key"
if ! ls "$cache"/*.whl >/dev/null 2>&1; then
  echo "building causal-conv1d $CAUSAL_CONV1D for sm_$arch into $cache (once per torch, CUDA, Python and GPU)"
  work=$(mktemp -d)
  python -m pip download -q --no-deps --no-binary :all: "causal-conv1d==$CAUSAL_CONV1D" -d "$work"
  tar xzf "$work"/causal_conv1d-*.tar.gz -C "$work"
  src=$(echo "$work"/causal_conv1d-"$CAUSAL_CONV1D")
  ARCH="$arch" python - "$src/setup.py" <<'PY'
import os, sys
path, arch = sys.argv[1], os.environ["ARCH"]
marker = "    # HACK: The compiler flag"
text = open(path).read()
assert marker in text, "causal-conv1d's setup.py changed: update scripts/setup_node.sh"
only_this_gpu = (f"    cc_flag = [f for f in cc_flag if f != '-gencode' and not f.startswith('arch=')]"
                 f" + ['-gencode', 'arch=compute_{arch},code=sm_{arch}']\n")
open(path, "w").write(text.replace(marker, only_this_gpu + marker, 1))
PY
  CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="$(nproc)" python -m pip wheel -q --no-build-isolation --no-deps \
    -w "$work/wheel" "$src"
  mkdir -p "$cache.tmp.$$" && cp "$work"/wheel/*.whl "$cache.tmp.$$"/ && mv -T "$cache.tmp.$$" "$cache" \
    || rm -rf "$cache.tmp.$$"  # another node finished the same build first
fi
python -m pip install --no-deps "$cache"/*.whl
python -c "import causal_conv1d, fla; print('causal-conv1d', causal_conv1d.__version__, '| fla', fla.__version__)"
