# Sourced at the start of each command on a GPU machine without a package index (docs/BENCHMARKS.md "Commands"):
#   source bench/device_env.sh
# Installs the packages the machine lacks from .device-deps (their wheels) into /tmp/site, points
# Triton's and Inductor's caches at /tmp, and restores them from .bench-assets/caches.tar.xz.part* when an earlier
# run saved them (bench/save_caches.sh): a cold start spends minutes compiling and autotuning
# flash-linear-attention's Triton kernels before step 1, and fla keeps its autotuning results in Triton's cache.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .device-deps/*.whl || return 1
tar xJf .device-deps/causal_conv1d-1.7.0-sm90-cp312-torch2.11-cu130.tar.xz -C /tmp/site || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# The prebuilt extension links libc10.so without an RPATH: it loads only after torch.
python3 -c "import torch, causal_conv1d_cuda, fla" || return 1
export TRITON_CACHE_DIR=/tmp/triton-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
if ls .bench-assets/caches.tar.xz.part* >/dev/null 2>&1; then
  cat .bench-assets/caches.tar.xz.part* | tar xJf - -C /tmp && echo "device_env: caches restored"
fi
[ -s .bench-assets/tok/tokenizer.json ] || xz -dc .bench-assets/tokenizer.json.xz > .bench-assets/tok/tokenizer.json
