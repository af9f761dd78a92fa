#!/usr/bin/env bash
# Installs the peer packages the side-by-side tests import: verl 0.9.1 with --no-deps,
# plus only what `import verl.trainer.ppo.core_algos` needs, in the versions verl states.
# torch and numpy stay as they are (constraints). A failure leaves the tests skipped with
# the reason, never failed.
set -uo pipefail
PY=${PYTHON:-python3}
if "$PY" -c "import verl.trainer.ppo.core_algos" 2>/dev/null; then
  echo "peers: verl importable"
  exit 0
fi
cons=$(mktemp)
"$PY" -c "import torch, numpy; print('torch==' + torch.__version__.split('+')[0]); print('numpy==' + numpy.__version__)" > "$cons"
"$PY" -m pip install -q --disable-pip-version-check --no-deps "verl==0.9.1" \
  && "$PY" -m pip install -q --disable-pip-version-check -c "$cons" ray "tensordict>=0.8,<=0.10,!=0.9.0" omegaconf \
    "transformers>=5.5.3,<5.11,!=5.6.0" codetiming \
  || echo "peers: could not install verl's import-time needs: its tests will be skipped"
rm -f "$cons"
if "$PY" -c "import verl.trainer.ppo.core_algos" 2>/dev/null; then echo "peers: verl importable"; else echo "peers: verl not importable: its tests will be skipped"; fi
