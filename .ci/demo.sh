#!/usr/bin/env bash
# `make demo`: the main job on the embedded default store (a local directory).
# Each step prints what it did. Later stages (build, daemon, run) join as they land.
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERCTL=.venv/bin/layerctl
WORK=$(mktemp -d -t layerstore-demo.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

say() { printf '\n== %s\n' "$*"; }

say "layerctl $($LAYERCTL --version | awk '{print $NF}'), store: ${LAYERSTORE_STORE:-the embedded default (\$XDG_DATA_HOME/layerstore/store)}"
$LAYERCTL store init

say "a real blob: this repository's source tree as a tar file"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
    --exclude=.venv --exclude=.git --exclude='__pycache__' --exclude='bench/.cache' -cf "$WORK/src.tar" .
ls -l "$WORK/src.tar"

say "store it (chunks are verified, compressed, deduplicated)"
$LAYERCTL store put-blob "$WORK/src.tar" --json | tee "$WORK/put.json"
BLOB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["blob"])' "$WORK/put.json")

say "store it again: nothing new is uploaded"
$LAYERCTL store put-blob "$WORK/src.tar" --json

say "read it back, verified, and compare"
$LAYERCTL store get-blob "$BLOB" "$WORK/back.tar"
cmp "$WORK/src.tar" "$WORK/back.tar" && echo "identical: $BLOB"

say "what the store holds"
$LAYERCTL store ls
$LAYERCTL store verify
