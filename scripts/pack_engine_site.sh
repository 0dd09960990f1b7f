#!/usr/bin/env bash
# Packs vLLM 0.26.0 or SGLang 0.5.17 for a GPU machine that has torch 2.11.0+cu130, Python 3.12
# and no package registry (bench/rollout/engines_gpu.sh unpacks them there):
#   bash scripts/pack_engine_site.sh vllm  /tmp/pack   # -> /tmp/pack/vllm_site.tar.xz.part-*
#   bash scripts/pack_engine_site.sh sglang /tmp/pack  # -> /tmp/pack/sgl_site.tar.xz.part-*
#   bash scripts/pack_engine_site.sh sglang_fa3 /tmp/pack  # -> /tmp/pack/sgl_fa3_site.tar.xz.part-*
#     (after `sglang`: SGLang's FA3 kernels, sgl_kernel/flash_ops.abi3.so, 1.1 GB unpacked, its
#     default attention on Hopper, in pieces of their own so that the engine tests can go without)
#
# 1. Resolve the engine's closure for cp312/manylinux with uv, excluding what the GPU image
#    already has (PRESENT, one name a line: the device README's package list).
# 2. Drop what an in-process engine never imports on Hopper and that would cost most of the
#    transfer: compiler toolchains (nvcc, nvvm, cutlass-dsl, tilelang), video codecs, the
#    Blackwell kernels and the CuTe DSL (imported only when a kernel asks for it, behind an
#    availability check), vLLM's FA2 library (FA3 serves Hopper) and Rust frontend, and
#    sgl_kernel's FA3 library (it travels in pieces of its own: `sglang_fa3` below).
# 3. `pip install --target` (no deps) for cp312, then tar | xz, split into 56 MiB pieces:
#    a device call carries at most 64 MiB.
set -euo pipefail
ENGINE=$1
DEST=${2:-/tmp/pack}
PRESENT=${PRESENT:-$DEST/gpu_present.txt}
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64)
PLATFORM_ARGS=(); for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done
mkdir -p "$DEST/wheels"
case $ENGINE in
  sglang_fa3)
    # The FA3 library the `sglang` site leaves out, from the same sglang-kernel wheel; xz -2: the
    # library barely compresses further at -6, and -2 takes minutes instead of a quarter hour.
    wheel=$(ls "$DEST"/wheels/sglang_kernel-*.whl | head -n 1)
    rm -rf "${DEST:?}/fa3" && mkdir -p "$DEST/fa3/site_sgl"
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('sgl_kernel/flash_ops.abi3.so', sys.argv[2])" \
      "$wheel" "$DEST/fa3/site_sgl"
    tar -C "$DEST/fa3" -cf - site_sgl | xz -T2 -2 >"$DEST/sgl_fa3_site.tar.xz"
    rm -rf "${DEST:?}/fa3"
    split -b 56M "$DEST/sgl_fa3_site.tar.xz" "$DEST/sgl_fa3_site.tar.xz.part-"
    ls -la "$DEST/sgl_fa3_site.tar.xz.part-"*
    exit 0 ;;
  vllm)
    SPEC=vllm==0.26.0; SITE=site_vllm; NAME=vllm
    SKIP='tokenspeed(-mla|-triton)?|nvidia-cutlass-dsl(-libs-[a-z0-9]+)?|nvidia-nvvm|nvidia-cuda-(nvcc|nvdisasm|cccl|crt)|tilelang|pynvvideocodec|z3-solver|torchcodec|humming-kernels|quack-kernels|cuda-tile'
    PINS=() ;;
  sglang)
    SPEC=sglang==0.5.17; SITE=site_sgl; NAME=sgl
    SKIP='tokenspeed(-mla|-triton)?|nvidia-cutlass-dsl(-libs-[a-z0-9]+)?|nvidia-nvvm|nvidia-cuda-(nvcc|nvdisasm|cccl|crt)|tilelang|z3-solver|torchcodec|nvidia-mathdx|helion|sgl-deep-gemm|flash-attn-4|quack-kernels|humming-kernels|cuda-tile'
    # SGLang 0.5.17 pins transformers 5.12.1, which refuses the image's tokenizers 0.23.2.
    PINS=(transformers==5.12.1 tokenizers==0.22.2) ;;
  *) echo "usage: $0 vllm|sglang|sglang_fa3 [dest]" >&2; exit 2 ;;
esac
echo "$SPEC" >"$DEST/req_$NAME.txt"
uv pip compile "$DEST/req_$NAME.txt" --python-version 3.12 --python-platform x86_64-manylinux_2_34 \
  --excludes "$PRESENT" --no-header --no-annotate -o "$DEST/lock_$NAME.txt"
grep -v -E "^($SKIP)==" "$DEST/lock_$NAME.txt" | grep -v -E '^(transformers|tokenizers)==' \
  >"$DEST/keep_$NAME.txt"
printf '%s\n' "${PINS[@]}" >>"$DEST/keep_$NAME.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORM_ARGS[@]}" -d "$DEST/wheels" -r "$DEST/keep_$NAME.txt"
rm -rf "${DEST:?}/$SITE"
python3 -m pip install -q --no-deps --no-compile --ignore-requires-python --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORM_ARGS[@]}" --target "$DEST/$SITE" -r "$DEST/keep_$NAME.txt" \
  --find-links "$DEST/wheels" --no-index
rm -rf "$DEST/$SITE/bin" \
  "$DEST/$SITE/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$DEST/$SITE/vllm/vllm-rs" \
  "$DEST/$SITE/sgl_kernel/flash_ops.abi3.so" "$DEST/$SITE/sgl_kernel/sm100"
tar -C "$DEST" -cf - "$SITE" | xz -T2 -6 >"$DEST/${NAME}_site.tar.xz"
split -b 56M "$DEST/${NAME}_site.tar.xz" "$DEST/${NAME}_site.tar.xz.part-"
ls -la "$DEST/${NAME}_site.tar.xz.part-"*
