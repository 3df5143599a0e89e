#!/usr/bin/env bash
# ci/sglang-env.sh VENV - a venv in which sglang's plugin loader and its CPU W8A8 layers import and run, for
# tests/test_sglang_plugin.py: VENV/bin/python -m pytest tests/test_sglang_plugin.py -q -p no:cacheprovider
# Creates VENV (--system-site-packages: torch 2.13.0, w8a8_cpu and the test tools come from the python3 that runs
# this script, where ci/test.sh installs this checkout) or updates it; idempotent; prints each step.
#   1. sglang 0.5.23 without its dependencies: they pin torch 2.14.1 and CUDA kernels (flashinfer, sglang-kernel,
#      ...); what remains are the pure-Python modules that `import sglang.srt.plugins` and
#      sglang.srt.layers.{linear, quantization.w8a8_int8, moe} import at module level, pinned (sglang's own pin where
#      it has one), plus triton, which sglang/srt/utils/common.py imports unconditionally; torch==2.13.0 is named in
#      the same command so that nothing they require can replace it.
#   2. torchvision, which sglang's model configs import at module level (sglang.srt.configs, via its MoE package).
#      The release made for torch 2.13 is 0.28.0; its CPU build is only on PyTorch's own index, and PyPI's x86_64
#      wheel is a CUDA build: its C++ ops cannot load beside a CPU torch, which torchvision tolerates except in two
#      fake-kernel registrations (torchvision::nms, ::qnms) that then fail its import. Those two are guarded here
#      with torchvision's own test (extension._has_ops()), so the pure-Python parts import; nothing sglang's CPU
#      W8A8 path runs uses torchvision's ops. A torchvision that imports as installed is left alone.
#   3. check: the modules the tests use import, and the plugin group lists w8a8_cpu's entry point.
set -euo pipefail
VENV=${1:?usage: ci/sglang-env.sh VENV}
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac  # absolute: the checks run from /
PY=${PYTHON:-python3}
SGLANG=sglang==0.5.23
TORCHVISION=torchvision==0.28.0
DEPS=(pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 msgspec==0.23.0 pyzmq==27.3.0 aiohttp==3.14.5
      apache-tvm-ffi==0.1.11 dill==0.4.1 sentencepiece==0.2.1 einops==0.8.2 openai==2.8.0
      partial_json_parser==0.2.1.1.post7)
T0=$SECONDS
log() { echo "[sglang-env $((SECONDS - T0))s] $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if [ -x "$VENV/bin/python" ]; then
  log "venv $VENV exists: updating it"
else
  log "venv $VENV: creating it (--system-site-packages, $("$PY" -c 'import sys; print(sys.executable)'))"
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY=$VENV/bin/python

log "1. pip install --no-deps $SGLANG $TORCHVISION; pip install ${DEPS[*]} torch==2.13.0" \
    "(pip then lists the requirements of sglang left out on purpose as conflicts)"
"$VPY" -m pip install --quiet --no-deps "$SGLANG" "$TORCHVISION"
"$VPY" -m pip install --quiet "${DEPS[@]}" torch==2.13.0

log "2. torchvision"
if "$VPY" -c "import torchvision" 2>/dev/null; then
  log "   imports as installed: left alone"
else
  META=$("$VPY" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")
  META=$META/_meta_registrations.py
  GUARDED='if torchvision.extension._has_ops() else (lambda fn: fn))'
  sed -i -E "s/^@torch\.library\.register_fake\((\"torchvision::(nms|qnms)\")\)\$/@(torch.library.register_fake(\1) $GUARDED/" \
    "$META"
  log "   its C++ ops do not load beside this torch: guarded $(grep -cF "$GUARDED" "$META") fake registrations in $META"
  "$VPY" -c "import torchvision"
fi

log "3. check"
(cd / && "$VPY" -W ignore - <<'EOF'
import importlib.metadata
import torch
import sglang
import sglang.srt.plugins
import sglang.srt.layers.linear
import sglang.srt.layers.quantization.w8a8_int8
from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=sglang.srt.plugins.GENERAL_PLUGINS_GROUP)}
print(f"   sglang {importlib.metadata.version('sglang')}, torch {torch.__version__}, "
      f"torchvision {importlib.metadata.version('torchvision')}; {sglang.srt.plugins.GENERAL_PLUGINS_GROUP}: {plugins}")
EOF
)
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
