#!/usr/bin/env bash
# Installs the peer packages the side-by-side tests import, each only when it is not already
# installed at its pinned version (the tests skip, with the reason, a peer that does not
# import); torch and numpy stay as they are (constraints):
# * verl 0.9.1 with --no-deps, plus only what `import verl.trainer.ppo.core_algos` needs,
#   in the versions verl states;
# * TRL 1.16.0 with its own (light) dependencies: accelerate, datasets, transformers;
# * megatron-core 0.19.2 with --no-deps (its needs, torch, numpy and packaging, are here);
#   it declares Python >= 3.12 but its files run on 3.11 (--ignore-requires-python).
# A failure leaves that peer's tests skipped with the reason, never failed.
set -uo pipefail
PY=${PYTHON:-python3}
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
"$PY" -c "import torch, numpy; print('torch==' + torch.__version__.split('+')[0]); print('numpy==' + numpy.__version__)" > "$cons"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# installed at the pinned version? (metadata only: importing the peers takes tens of seconds)
have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1') == '$2' else 1)" 2>/dev/null; }

if have verl 0.9.1; then
  echo "peers: verl 0.9.1 installed"
else
  pip_install --no-deps "verl==0.9.1" \
    && pip_install -c "$cons" ray "tensordict>=0.8,<=0.10,!=0.9.0" omegaconf "transformers>=5.5.3,<5.11,!=5.6.0" codetiming \
    || echo "peers: could not install verl's import-time needs: its tests will be skipped"
  if "$PY" -c "import verl.trainer.ppo.core_algos" 2>/dev/null; then echo "peers: verl importable"; else echo "peers: verl not importable: its tests will be skipped"; fi
fi

trl_check="from trl import GRPOTrainer, GRPOConfig; import datasets, tokenizers"
if have trl 1.16.0; then
  echo "peers: trl 1.16.0 installed"
else
  pip_install -c "$cons" "trl==1.16.0" "transformers>=5.5.3,<5.11,!=5.6.0" \
    || echo "peers: could not install TRL: its tests will be skipped"
  if "$PY" -c "$trl_check" 2>/dev/null; then echo "peers: trl importable"; else echo "peers: trl not importable: its tests will be skipped"; fi
fi

mcore_check="from megatron.core.pipeline_parallel import get_forward_backward_func; from megatron.core.distributed import DistributedDataParallel"
if have megatron-core 0.19.2; then
  echo "peers: megatron-core 0.19.2 installed"
else
  pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2" packaging \
    || echo "peers: could not install megatron-core: its tests will be skipped"
  if "$PY" -c "$mcore_check" 2>/dev/null; then echo "peers: megatron-core importable"; else echo "peers: megatron-core not importable: its tests will be skipped"; fi
fi
