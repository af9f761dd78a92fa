#!/usr/bin/env bash
# Makes the trainer slime (THUDM/slime 624b824, not on the package registry) importable for the
# tests that run its code, without touching site-packages:
# * its sources are unpacked from ../shared/peers/slime-624b824.tar.gz into build/peers/slime;
# * what its imports need beyond site-packages (torch 2.14.1, megatron-core 0.19.2, transformers, ...)
#   is pip-installed, pinned and with --no-deps, into build/peers/slime-deps.
# The test processes put both first on sys.path, and, since megatron-core 0.19.2's
# megatron/training/models/{gpt,hybrid}.py do `from typing import override` (Python 3.12+), run
#   import typing, typing_extensions; typing.override = getattr(typing, "override", typing_extensions.override)
# before importing megatron (no file of slime or megatron is changed).
#
# Pins: sglang 0.5.15.post1 is the newest release whose tree holds every sglang module slime 624b824
# imports (0.5.16 dropped srt/layers/attention/dsa/{quant,dequant}_k_cache and fp8_kernel, 0.5.17
# moved sglang.jit_kernel to sglang.kernels); sglang-router 0.3.2 is the newest (slime asks >= 0.3.0).
# The rest is exactly what `import slime.utils.arguments` (sglang's import chain, wandb) and
# `import slime.backends.megatron_utils.model` (wandb) load and a fresh virtualenv lacks after
# scripts/setup.sh and the other peers (CI's; IPython, traitlets and sniffio come with the machine's
# Python, not with a fresh virtualenv, and sglang.utils imports IPython); versions are
# sglang's / openai's own pins where they pin, the miles peer's (scripts/install_peers.sh) where it has
# the package, else the newest. torch and numpy are never installed (--no-deps; pip's constraints).
#
# Each part has a stamp file, so a second run is a no-op. One line on success, one naming the
# failure otherwise (pip's output: build/peers/slime-deps/.install.log).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# the archive lies in the project's peers folder, ../shared/peers from the project's root; a clone made
# elsewhere (CI's clean clone) finds it up to two folders higher or beside the repository it was cloned from;
# LOSSAGG_PEERS_DIR overrides
NAME=slime-624b824.tar.gz
ARCHIVE=""
origin=$(git config --get remote.origin.url 2>/dev/null || true)
for dir in ${LOSSAGG_PEERS_DIR:+"$LOSSAGG_PEERS_DIR"} ../shared/peers ../../shared/peers ../../../shared/peers ${origin:+"${origin%/}/../shared/peers"}; do
  if [ -f "$dir/$NAME" ]; then
    ARCHIVE="$dir/$NAME"
    break
  fi
done
COMMIT=624b824a898ab0ec1fcb4d373004c7f3852bf515
SLIME_DIR=build/peers/slime
DEPS_DIR=build/peers/slime-deps
DEPS="sglang==0.5.15.post1 sglang-router==0.3.2 \
  openai==2.6.1 distro==1.9.0 msgspec==0.23.0 pybase64==1.5.1 partial_json_parser==0.2.1.1.post7 \
  sentencepiece==0.2.3 setproctitle==1.3.8 pyzmq==27.3.0 torchvision==0.29.1 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 \
  wandb==0.31.0 platformdirs==4.14.9 opentelemetry-api==1.45.2 \
  ipython==9.18.1 traitlets==5.16.1 sniffio==1.3.1"

fail() { echo "slime: FAILED: $*"; exit 1; }
start=$SECONDS

# 1. slime's sources, at that commit
[ -n "$ARCHIVE" ] || fail "$NAME not found in \$LOSSAGG_PEERS_DIR, ../shared/peers or beside the repository this one was cloned from ($origin)"
src_stamp="slime $COMMIT $(sha256sum "$ARCHIVE" | cut -d' ' -f1)"
did=""
if [ "$(cat "$SLIME_DIR/.lossagg-stamp" 2>/dev/null)" != "$src_stamp" ]; then
  rm -rf "$SLIME_DIR" && mkdir -p "$SLIME_DIR" \
    && tar -xzf "$ARCHIVE" -C "$SLIME_DIR" --strip-components=1 \
    && [ -f "$SLIME_DIR/slime/utils/arguments.py" ] \
    || fail "could not unpack $ARCHIVE into $SLIME_DIR"
  echo "$src_stamp" > "$SLIME_DIR/.lossagg-stamp"
  did="unpacked slime $COMMIT"
fi

# 2. the pinned dependencies of its imports
py_ver=$("$PY" -c 'import sys, importlib.metadata as m; print("python=%d.%d torch=%s" % (sys.version_info[:2] + (m.version("torch"),)))' 2>/dev/null) \
  || fail "$PY or its torch is not usable"
deps_stamp="$DEPS $py_ver"
log="$DEPS_DIR/.install.log"
# --fetch: only the files (the sources and the pinned dependencies, into their own directories), no import check:
# scripts/install_peers.sh runs it beside the site-packages peers, and this script again after them, which then
# checks the imports (slime imports megatron-core and transformers from site-packages)
if [ "$(cat "$DEPS_DIR/.lossagg-stamp" 2>/dev/null)" != "$deps_stamp" ] && [ "$(cat "$DEPS_DIR/.lossagg-fetched" 2>/dev/null)" != "$deps_stamp" ]; then
  rm -rf "$DEPS_DIR" && mkdir -p "$DEPS_DIR" || fail "could not create $DEPS_DIR"
  # shellcheck disable=SC2086
  "$PY" -m pip install --disable-pip-version-check --no-deps --only-binary=:all: --target "$DEPS_DIR" $DEPS >"$log" 2>&1 \
    || fail "pip could not install the pinned dependencies into $DEPS_DIR (pip's output: $log)"
  for forbidden in torch numpy; do
    [ ! -e "$DEPS_DIR/$forbidden" ] || fail "pip put $forbidden into $DEPS_DIR (see $log)"
  done
  echo "$deps_stamp" > "$DEPS_DIR/.lossagg-fetched"
  did="${did:+$did, }installed its dependencies into $DEPS_DIR ($(du -sh "$DEPS_DIR" | cut -f1))"
fi
if [ "${1:-}" = "--fetch" ]; then
  echo "slime: ${did:-files already there} ($((SECONDS - start)) s)"
  exit 0
fi

if [ "$(cat "$DEPS_DIR/.lossagg-stamp" 2>/dev/null)" != "$deps_stamp" ]; then
  check="import sys, typing, typing_extensions
typing.override = getattr(typing, 'override', typing_extensions.override)
sys.path[:0] = ['$SLIME_DIR', '$DEPS_DIR']
import slime.utils.arguments, slime.backends.megatron_utils.model, slime.backends.megatron_utils.loss
import slime.backends.megatron_utils.data, slime.backends.megatron_utils.cp_utils, slime.utils.dp_schedule
import slime.utils.accelerator, slime.utils.misc, slime.observability.rollout_data_utils, megatron.training.global_vars"
  "$PY" -c "$check" >>"$log" 2>&1 \
    || fail "installed into $DEPS_DIR, but slime does not import (traceback at the end of $log)"
  echo "$deps_stamp" > "$DEPS_DIR/.lossagg-stamp"
  did="${did:+$did, }checked its imports"
fi

if [ -n "$did" ]; then
  echo "slime: $did ($((SECONDS - start)) s)"
else
  echo "slime: $COMMIT and its dependencies already in $SLIME_DIR, $DEPS_DIR"
fi
