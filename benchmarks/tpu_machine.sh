#!/usr/bin/env bash
# The package on a TPU machine as a user installs it, then its checks there,
# each writing into $OUT (default ./tpu_out) as it goes, so a run cut short
# keeps what it measured:
#
#   OUT=/tmp/out bash benchmarks/tpu_machine.sh [STAGE ...]
#
# Stages (default: all, in this order): install, check (gpu_check's blocks,
# features and gradient modes on the chip), attention (the UT-ACT model,
# benchmarks/attention_check.py), tests (the release tests on the machine's
# CPU, JAX_PLATFORMS=cpu, failures named), examples (the ported models on the
# chip), time (gpu_check's timings).
#
# `pip install --user .` (in a virtual environment: `pip install .`) keeps the machine's JAX (pip finds it satisfied);
# PIP_INDEX_URL names a local index on a machine without network (the TPU
# v5e machine here: file:///opt/pypi/simple). Every check runs from a copy of
# the repository without pallas_loop/ and reference/, so `import pallas_loop`
# finds the install. Run in one process at a time: one program holds the chip.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/tpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONUSERBASE="${PYTHONUSERBASE:-/tmp/userbase}"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(install check attention tests examples time)
COPY=/tmp/pallas_loop_checks
LOG="$OUT/stages.log"

stage() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
done_() { echo "   rc=$1" | tee -a "$LOG"; }

for s in "${STAGES[@]}"; do
  case "$s" in
    install)
      stage "pip install --user . (and the checks' extras: flax, pytest-xdist; equinox where the index has it)"
      ( python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
        printf 'jax==%s\njaxlib==%s\n' "$(python3 -c 'import jax; print(jax.__version__)')" \
          "$(python3 -c 'import jaxlib; print(jaxlib.__version__)')" > /tmp/pins.txt
        # --user where there is a user site; inside a virtual environment, the environment.
        WHERE=$(python3 -c 'import site; print("--user" if site.ENABLE_USER_SITE else "")')
        python3 -m pip uninstall -y pallas-loop
        python3 -m pip install $WHERE -c /tmp/pins.txt . \
          && python3 -m pip install $WHERE -c /tmp/pins.txt flax pytest-xdist
        rc=$?
        # Equinox is not in the TPU machine's own index (KINDS.md): its checks
        # are skipped where it does not install.
        python3 -m pip install $WHERE -c /tmp/pins.txt equinox || echo "equinox: not installed"
        exit $rc
      ) > "$OUT/install.log" 2>&1
      done_ $?
      rm -rf "$COPY" && mkdir -p "$COPY" && cp -r . "$COPY/" \
        && rm -rf "$COPY/pallas_loop" "$COPY/reference" "$COPY/.git"
      (cd "$COPY" && python3 -c 'import pallas_loop; print("pallas_loop", pallas_loop.__version__, "from", pallas_loop.__file__)') | tee -a "$LOG"
      ;;
    check)
      stage "gpu_check: blocks, features, gradient modes"
      (cd "$COPY" && timeout 600 python3 -m benchmarks.gpu_check --repeats 5 --budget 500 \
        --only check --only feature --only "gradient modes" --out "$OUT/check.jsonl") > "$OUT/check.log" 2>&1
      done_ $?
      ;;
    attention)
      stage "attention_check: the UT-ACT model, both dtypes, default and pallas"
      (cd "$COPY" && timeout 900 python3 -m benchmarks.attention_check --out "$OUT/attention.jsonl") \
        > "$OUT/attention.log" 2>&1
      done_ $?
      ;;
    tests)
      stage "the release tests on the machine's CPU"
      (cd "$COPY" && JAX_PLATFORMS=cpu timeout 900 python3 -m pytest -q -rf -p no:cacheprovider \
        -p no:benchmark tests/test_forward.py tests/test_gradients.py tests/test_lowering.py \
        tests/test_keys.py tests/test_random.py tests/test_sharding.py tests/test_fast_math.py \
        tests/test_kernel_tpu_groups.py tests/test_act.py) > "$OUT/tests.log" 2>&1
      done_ $?
      ;;
    examples)
      for ex in act ponder_net deq_training flax_dropout recurrent_depth; do
        stage "examples/$ex.py"
        (cd "$COPY" && timeout 300 python3 "examples/$ex.py") > "$OUT/example_$ex.log" 2>&1
        done_ $?
      done
      ;;
    time)
      stage "gpu_check: timings inside one jit"
      (cd "$COPY" && timeout 900 python3 -m benchmarks.gpu_check --repeats 5 --budget 800 \
        --only time --out "$OUT/time.jsonl") > "$OUT/time.log" 2>&1
      done_ $?
      ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
