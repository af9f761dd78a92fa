#!/usr/bin/env bash
# Installs the peer packages the side-by-side tests import, each only when it is not already
# installed at its pinned version (the tests skip, with the reason, a peer that does not
# import); torch and numpy stay as they are (constraints):
# * verl 0.9.1 with --no-deps, plus only what `import verl.trainer.ppo.core_algos` needs,
#   in the versions verl states, and what `verl.trainer.ppo.ray_trainer` (lossagg_trainer's base) adds:
#   cachetools and fastapi;
# * TRL 1.16.0 with its own (light) dependencies: accelerate, datasets, transformers;
# * megatron-core 0.19.2 with --no-deps (its needs, torch, numpy and packaging, are here);
#   it declares Python >= 3.12 but its files run on 3.11 (--ignore-requires-python);
# * SkyRL 0.4.0 (PyPI: skyrl) with --no-deps and --ignore-requires-python (it declares Python
#   >= 3.12 too), plus only what `skyrl.backends.skyrl_train.utils.ppo_utils` imports: skyrl-gym
#   0.4.0 (--no-deps) and jaxtyping, loguru, ray, omegaconf, PyYAML, pandas, requests
#   (tests/skyrl_peer.py says how that module is imported on Python < 3.12).
# * OpenRLHF 0.11.2 with --no-deps, plus torchdata 0.11.0 (--no-deps); the imports its training step never
#   uses (deepspeed, flash-attn, vLLM, pylatexenc) are stood in by tests/openrlhf_peer.py, which says why.
# * AReaL 1.0.4 (PyPI: areal) with --no-deps and --ignore-requires-python, plus only what its FSDP engine and
#   PPO actor import (areal/__init__ imports its launchers, stats loggers and OpenAI proxy): aiohttp, colorlog,
#   tenacity, flask, lark, uvloop, numba, einops, aiofiles, openai, swanlab, trackio, wandb, tensorboardX,
#   tabulate, pybase64, pinned (tests/test_areal_trainer.py).
# * miles-rl 0.0.2 with --no-deps --target build/peers/miles: it vendors its own `megatron` (and
#   parts of `sglang`), which would overwrite megatron-core's files in site-packages, so it lives in
#   a directory of its own that only the processes testing miles put first on sys.path
#   (tests/miles_peer.py); what `miles.utils.arguments` and `miles.backends.megatron_utils.model`
#   import, pinned, with --no-deps into build/peers/miles-deps beside it.
# A failure leaves that peer's tests skipped with the reason, never failed (slime's fail under CI). pip's output is in
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
# verl's trainer module (the base of lossagg.integrations.verl.lossagg_trainer, tests/test_verl_trainer.py) imports these
# too (uvicorn, fastapi and cachetools for its rollout server), and torchdata (SkyRL's), datasets (TRL's), peft and pillow
install_verl_trainer() { pip_install -c "$cons" "cachetools==8.0.3" "fastapi==0.165.0" "uvicorn==0.55.0"; }
# verl's config objects (omega_conf_to_dataclass, used by lossagg.integrations.verl.install) import hydra
install_hydra() { pip_install -c "$cons" "hydra-core==1.3.2"; }
# verl's FSDP engine (tests/test_verl_engine.py) imports peft; its own needs are verl's and TRL's (installed first)
install_peft() { pip_install --no-deps "peft==0.21.2"; }
install_trl() { pip_install -c "$cons" "trl==1.16.0" "transformers>=5.5.3,<5.11,!=5.6.0"; }
install_mcore() { pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2" packaging; }
install_skyrl() {
  pip_install --no-deps --ignore-requires-python "skyrl==0.4.0" "skyrl-gym==0.4.0" "torchdata==0.11.0" \
    && pip_install -c "$cons" jaxtyping loguru ray omegaconf pyyaml pandas requests
}
install_areal() {
  pip_install --no-deps --ignore-requires-python "areal==1.0.4" \
    && pip_install -c "$cons" "aiohttp==3.14.5" "colorlog==6.12.0" "tenacity==9.2.1" "flask==3.1.3" "lark==1.3.1" "uvloop==0.23.0" \
      "numba==0.68.1" "einops==0.8.2" "aiofiles==25.1.0" "openai==3.63.0" "swanlab==0.10.3" "trackio==0.43.0" "wandb==0.31.0" \
      "tensorboardX==2.6.5" "tabulate==0.10.0" "pybase64==1.5.1"
}

# miles and slime live in directories of their own (below): their files are fetched by a second pip beside the
# site-packages peers, and their imports checked after them (they import megatron-core and transformers)
MILES_DIR=build/peers/miles
MILES_DEPS_DIR=build/peers/miles-deps
MILES_DEPS="sglang-router==0.3.2 setproctitle==1.3.8 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 \
  aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 \
  opentelemetry-api==1.45.2 pybase64==1.5.1 openai==3.57.0 httpx2==2.16.2 partial_json_parser==0.2.1.1.post7 pyzmq==27.3.0 \
  sentencepiece==0.2.3 torchvision==0.29.1 ipython==9.18.1 traitlets==5.16.1 sniffio==1.3.1 six==1.17.0"
miles_stamp() { echo "miles-rl==0.0.2 $MILES_DEPS python=$("$PY" -c 'import sys; print(sys.version_info[:2])')"; }
fetch_miles() {
  [ "$(cat "$MILES_DIR/.lossagg-stamp" 2>/dev/null)" = "$(miles_stamp)" ] && return 0
  rm -rf "$MILES_DIR" "$MILES_DEPS_DIR"
  # shellcheck disable=SC2086
  pip_install --no-deps --target "$MILES_DIR" "miles-rl==0.0.2" && pip_install --no-deps --target "$MILES_DEPS_DIR" $MILES_DEPS \
    && miles_stamp > "$MILES_DIR/.lossagg-fetched"
}
mkdir -p "$LOSSAGG_LOG_DIR"
fetch_log="$LOSSAGG_LOG_DIR/peers-fetch-miles-slime.log"
{ fetch_miles; bash scripts/install_slime.sh --fetch; } >"$fetch_log" 2>&1 &
fetch_pid=$!

peer verl 0.9.1 "import verl.trainer.ppo.core_algos" install_verl
peer hydra-core 1.3.2 "import hydra" install_hydra
peer trl 1.16.0 "from trl import GRPOTrainer, GRPOConfig; import datasets, tokenizers" install_trl
# after TRL, which brings accelerate: peft imports it (checked once it can be there)
peer peft 0.21.2 "import peft" install_peft
peer megatron-core 0.19.2 \
  "from megatron.core.pipeline_parallel import get_forward_backward_func; from megatron.core.distributed import DistributedDataParallel" \
  install_mcore
# its trainer (tests/test_skyrl_trainer.py) needs torchdata as well
peer skyrl 0.4.0 "import sys; sys.path.insert(0, 'tests'); import skyrl_peer; skyrl_peer.ppo_utils(); skyrl_peer.trainer()" install_skyrl
# verl's trainer module: after TRL (datasets), peft and SkyRL (torchdata)
peer cachetools 8.0.3 "import verl.trainer.ppo.ray_trainer" install_verl_trainer
# after TRL and SkyRL, which bring transformers, peft's accelerate, ray and torchdata
install_openrlhf() { pip_install --no-deps "openrlhf==0.11.2" "torchdata==0.11.0"; }
peer openrlhf 0.11.2 "import sys; sys.path.insert(0, 'tests'); import openrlhf_peer; openrlhf_peer.ppo_actor()" install_openrlhf
# its FSDP engine and PPO actor (tests/test_areal_trainer.py), after TRL (transformers) and SkyRL (torchdata)
peer areal 1.0.4 "from areal.engine.fsdp_engine import FSDPPPOActor; from areal.trainer.ppo.actor import PPOActor" install_areal

# miles: its own directories, not site-packages (see above); "installed" is the stamp file, written once its
# imports, which also need what the peers above bring (transformers, attrs), work
wait "$fetch_pid"
miles_check="import sys; sys.path[:0] = ['$MILES_DIR', '$MILES_DEPS_DIR']; import miles.utils.arguments, miles.backends.megatron_utils.model, miles.backends.training_utils.loss"
if [ "$(cat "$MILES_DIR/.lossagg-stamp" 2>/dev/null)" = "$(miles_stamp)" ]; then
  echo "peers: miles-rl 0.0.2 already installed ($MILES_DIR)"
else
  log="$LOSSAGG_LOG_DIR/peers-miles-rl.log" start=$SECONDS
  { cat "$fetch_log"; [ "$(cat "$MILES_DIR/.lossagg-fetched" 2>/dev/null)" = "$(miles_stamp)" ] || fetch_miles; } >"$log" 2>&1
  if [ "$(cat "$MILES_DIR/.lossagg-fetched" 2>/dev/null)" = "$(miles_stamp)" ] && "$PY" -c "$miles_check" >>"$log" 2>&1; then
    miles_stamp > "$MILES_DIR/.lossagg-stamp"
    echo "peers: installed miles-rl 0.0.2 into $MILES_DIR (its imports checked in $((SECONDS - start)) s; fetched beside the others)"
  else
    rm -f "$MILES_DIR/.lossagg-stamp"
    echo "peers: miles-rl 0.0.2 could not be installed or imported (pip's output: $log): its tests will be skipped"
  fi
fi

# slime (THUDM/slime 624b824): not on the registry; its source comes with the project's peers
# (../shared/peers/) and its import-time needs go into a directory of its own (scripts/install_slime.sh,
# tests/slime_peer.py). After megatron-core, which slime imports. Its tests fail under CI when it is missing.
echo "peers: $(bash scripts/install_slime.sh)"
