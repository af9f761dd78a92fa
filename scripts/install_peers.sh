#!/usr/bin/env bash
# Installs the peer packages the side-by-side tests import, each only when it is not already
# installed at its pinned version (the tests skip, with the reason, a peer that does not
# import); torch and numpy stay as they are (constraints):
# * verl 0.9.1 with --no-deps, plus only what `import verl.trainer.ppo.core_algos` needs,
#   in the versions verl states;
# * TRL 1.16.0 with its own (light) dependencies: accelerate, datasets, transformers;
# * megatron-core 0.19.2 with --no-deps (its needs, torch, numpy and packaging, are here);
#   it declares Python >= 3.12 but its files run on 3.11 (--ignore-requires-python);
# * SkyRL 0.4.0 (PyPI: skyrl) with --no-deps and --ignore-requires-python (it declares Python
#   >= 3.12 too), plus only what `skyrl.backends.skyrl_train.utils.ppo_utils` imports: skyrl-gym
#   0.4.0 (--no-deps) and jaxtyping, loguru, ray, omegaconf, PyYAML, pandas, requests
#   (tests/skyrl_peer.py says how that module is imported on Python < 3.12).
# A failure leaves that peer's tests skipped with the reason, never failed. pip's output is in
# build/logs/peers-*.log: installing verl with --no-deps makes pip's resolver list the
# dependencies verl declares and the tests do not need, which is expected, not an error.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
. scripts/steps.sh
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
"$PY" -c "import torch, numpy; print('torch==' + torch.__version__.split('+')[0]); print('numpy==' + numpy.__version__)" > "$cons"
# installed at the pinned version? (metadata only: importing the peers takes tens of seconds)
have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1') == '$2' else 1)" 2>/dev/null; }
# peer NAME VERSION IMPORT_CHECK INSTALL_FUNCTION
peer() {
  local name=$1 version=$2 check=$3 install=$4
  if have "$name" "$version"; then
    echo "peers: $name $version already installed"
    return
  fi
  local log="$LOSSAGG_LOG_DIR/peers-$name.log" start=$SECONDS
  if "$install" >"$log" 2>&1 && "$PY" -c "$check" >>"$log" 2>&1; then
    echo "peers: installed $name $version ($((SECONDS - start)) s)"
  else
    echo "peers: $name $version could not be installed or imported (pip's output: $log): its tests will be skipped"
  fi
}

install_verl() {
  pip_install --no-deps "verl==0.9.1" \
    && pip_install -c "$cons" ray "tensordict>=0.8,<=0.10,!=0.9.0" omegaconf "transformers>=5.5.3,<5.11,!=5.6.0" codetiming
}
install_trl() { pip_install -c "$cons" "trl==1.16.0" "transformers>=5.5.3,<5.11,!=5.6.0"; }
install_mcore() { pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2" packaging; }
install_skyrl() {
  pip_install --no-deps --ignore-requires-python "skyrl==0.4.0" "skyrl-gym==0.4.0" \
    && pip_install -c "$cons" jaxtyping loguru ray omegaconf pyyaml pandas requests
}

peer verl 0.9.1 "import verl.trainer.ppo.core_algos" install_verl
peer trl 1.16.0 "from trl import GRPOTrainer, GRPOConfig; import datasets, tokenizers" install_trl
peer megatron-core 0.19.2 \
  "from megatron.core.pipeline_parallel import get_forward_backward_func; from megatron.core.distributed import DistributedDataParallel" \
  install_mcore
peer skyrl 0.4.0 "import sys; sys.path.insert(0, 'tests'); import skyrl_peer; skyrl_peer.ppo_utils()" install_skyrl
