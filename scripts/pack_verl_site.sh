#!/usr/bin/env bash
# Packs verl 0.9.1 (+ Ray and its other missing needs) for the GPU machine (torch 2.11.0+cu130,
# Python 3.12, no registry); bench/verl/verl_gpu.sh unpacks it there into /root/site_verl:
#   bash scripts/pack_verl_site.sh /work/packs   # -> /work/packs/verl_site.tar.xz.part-*
#
# verl 0.9.1: the newest on PyPI, and the first whose own pins are the machine's torch (its
# `vllm` extra: torch==2.11.0, vllm==0.24.0, transformers==5.9.0). Its code checks vLLM only from
# below (>= 0.22), and every vLLM module and name it imports on the colocated FSDP + vLLM path
# is in vLLM 0.26.0, which yatt already carries (scripts/pack_engine_site.sh vllm): so no second
# vLLM; site_vllm goes on the path after this site. verl wants transformers >=5.5.3,<5.11 (the
# machine has 5.17) and vLLM 0.26 takes >= 5.5.3: this site carries transformers 5.9.0 (verl's
# own pin), first on the path, for every process of the verl run (vLLM's too).
#
# 1. Resolve verl + vLLM 0.26.0 together for cp312/manylinux with uv, excluding what the GPU image
#    has (PRESENT, one name a line; made from the device README's package list when missing),
#    so that what verl adds agrees with vLLM's pins (fastapi, pydantic, pyzmq, ...).
# 2. Keep only what vLLM's site does not already hold (its own lock, as pack_engine_site.sh
#    makes it), plus transformers and the tokenizers it accepts (the vLLM site carries neither).
# 3. Drop what verl never imports on this path (trainer.logger=[console,file], FSDP engine,
#    vLLM rollout and reward model, no Megatron, no W&B): wandb (and its sentry,
#    gitpython), Ray's dashboard extras (ray[default]: opencensus, py-spy, smart-open,
#    virtualenv, aiohttp-cors, colorful), mbridge, torchcodec, qwen-vl-utils.
# 4. `pip install --target` (no deps), tar | xz, 56 MiB pieces (a device call carries 64 MiB).
set -euo pipefail
DEST=${1:-/work/packs}
PRESENT=${PRESENT:-$DEST/gpu_present.txt}
KINDS=${KINDS:-/work/.library/device/KINDS.md}
VERL=${VERL_SPEC:-verl==0.9.1}
VLLM=${VLLM_SPEC:-vllm==0.26.0}
TRANSFORMERS=${TRANSFORMERS_SPEC:-transformers==5.9.0}
SITE=site_verl
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64)
PLATFORM_ARGS=(); for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done
mkdir -p "$DEST/wheels_verl"

if [ ! -s "$PRESENT" ]; then
  # The device README's "Python packages already there" line: "... Packages: a, b, c."
  [ -r "$KINDS" ] || { echo "no $PRESENT and no $KINDS to make it from" >&2; exit 2; }
  grep -m1 -o 'Packages: .*' "$KINDS" | sed 's/^Packages: //; s/\.$//' | tr ',' '\n' \
    | sed 's/^ *//; s/ *$//' | grep -v '^$' >"$PRESENT"
fi
# The image's transformers/tokenizers are the wrong versions for verl: resolve them here.
grep -v -x -E 'transformers|tokenizers' "$PRESENT" >"$DEST/present_verl.txt"

compile() {  # compile OUT SPEC...: the cp312 manylinux lock of SPEC minus the image's packages
  local out=$1; shift
  printf '%s\n' "$@" >"$out.in"
  uv pip compile "$out.in" --python-version 3.12 --python-platform x86_64-manylinux_2_34 \
    --excludes "$DEST/present_verl.txt" --no-header --no-annotate -o "$out" -q
}
# Ray 2.54.1: the version seen starting a local cluster and placing GPU actors there.
# TransferQueue: verl 0.9.1's default trainer (trainer.use_v1=true) moves every batch through it.
compile "$DEST/lock_verl_vllm.txt" "$VERL" "$VLLM" "$TRANSFORMERS" "${RAY_SPEC:-ray==2.54.1}" \
  "${TQ_SPEC:-TransferQueue==0.1.11}" orjson
# What site_vllm already holds: vLLM's own lock against the full PRESENT (as pack_engine_site.sh).
uv pip compile <(echo "$VLLM") --python-version 3.12 --python-platform x86_64-manylinux_2_34 \
  --excludes "$PRESENT" --no-header --no-annotate -o "$DEST/lock_vllm_only.txt" -q
names() { sed -E 's/[=<>!~; ].*//' "$1" | tr 'A-Z_.' 'a-z--' | grep -v '^$' | sort -u; }
names "$DEST/lock_vllm_only.txt" >"$DEST/in_vllm_site.txt"

SKIP='wandb|cwevals|distro|python-discovery|sentry-sdk|gitpython|gitdb|smmap|docker-pycreds|setproctitle|opencensus|opencensus-context|py-spy|smart-open|virtualenv|distlib|platformdirs|aiohttp-cors|colorful|google-api-core|googleapis-common-protos|proto-plus|google-auth|pyasn1|pyasn1-modules|rsa|py-cpuinfo|mbridge|torchcodec|qwen-vl-utils|av|mathruler|pytest.*|pre-commit'
: >"$DEST/keep_verl.txt"
while IFS= read -r line; do
  name=$(echo "$line" | sed -E 's/[=<>!~; ].*//' | tr 'A-Z_.' 'a-z--')
  [ -z "$name" ] && continue
  echo "$name" | grep -q -x -E "$SKIP" && continue
  grep -q -x "$name" "$DEST/in_vllm_site.txt" && continue
  echo "$line" >>"$DEST/keep_verl.txt"
done <"$DEST/lock_verl_vllm.txt"
echo "== carried in $SITE:"; cat "$DEST/keep_verl.txt"

# One at a time: a pure-Python package published only as an sdist (antlr4-python3-runtime
# 4.9.3, which omegaconf 2.3 pins) is built into a wheel here instead.
while IFS= read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORM_ARGS[@]}" -d "$DEST/wheels_verl" --find-links "$DEST/wheels_verl" "$req" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w "$DEST/wheels_verl" "$req"
done <"$DEST/keep_verl.txt"
rm -rf "${DEST:?}/$SITE"
python3 -m pip install -q --no-deps --no-compile --ignore-requires-python --only-binary=:all: \
  --python-version 3.12 --implementation cp "${PLATFORM_ARGS[@]}" --target "$DEST/$SITE" \
  -r "$DEST/keep_verl.txt" --find-links "$DEST/wheels_verl" --no-index
# Ray's dashboard front end and its bundled thirdparty jars/binaries are never started
# (include_dashboard=False in bench/verl/verl_step.py); verl's wheel ships a top-level `tests`
# package that would shadow others.
rm -rf "$DEST/$SITE/bin" "$DEST/$SITE/ray/dashboard/client" "$DEST/$SITE/ray/jars" \
  "$DEST/$SITE/ray/tests" "$DEST/$SITE/tests"
find "$DEST/$SITE" -name '__pycache__' -prune -exec rm -rf {} +
du -sh "$DEST/$SITE"
rm -f "$DEST/verl_site.tar.xz" "$DEST/verl_site.tar.xz.part-"*
tar -C "$DEST" -cf - "$SITE" | xz -T2 -6 >"$DEST/verl_site.tar.xz"
split -b 56M "$DEST/verl_site.tar.xz" "$DEST/verl_site.tar.xz.part-"
ls -la "$DEST/verl_site.tar.xz.part-"*
