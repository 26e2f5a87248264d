#!/usr/bin/env bash
# Packs the Triton and Inductor caches of this run into DIR/caches.tar.xz.part* (15 MiB parts, small enough to
# copy back from the GPU machine). Copy them into .bench-assets/ and the next run's bench/device_env.sh restores them.
set -uo pipefail
DIR=$1
tar cf - -C /tmp triton-cache inductor-cache | xz -T0 -6 | split -b 15M - "$DIR/caches.tar.xz.part"
ls -la "$DIR"/caches.tar.xz.part*
