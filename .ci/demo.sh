#!/usr/bin/env bash
# `make demo`: the main job on the embedded default store (a local directory):
# build three layers, name an environment, start sandboxes from it lazily, commit one, resume it.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
LAYERCTL=$REPO/.venv/bin/layerctl
WORK=$(mktemp -d -t layerstore-demo.XXXXXX)
NODE=$WORK/node
export LAYERSTORE_NODE_DIR=$NODE

cleanup() {
    # sandboxes first (they hold the layer mounts), then the node daemon, then the files
    for sb in $("$LAYERCTL" sandbox ls --json 2>/dev/null | python3 -c \
        'import json,sys; [print(s["sandbox"]) for s in json.load(sys.stdin)]' 2>/dev/null); do
        "$LAYERCTL" sandbox rm "$sb" >/dev/null 2>&1 || true
    done
    "$LAYERCTL" node stop >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n== %s\n' "$*"; }
field() { python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }

say "layerctl $($LAYERCTL --version | awk '{print $NF}'), store: ${LAYERSTORE_STORE:-the embedded default (\$XDG_DATA_HOME/layerstore/store)}"
$LAYERCTL store init

say "base layer: a Debian bookworm userland (mmdebstrap from this machine's apt sources, cached)"
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/layerstore/demo
BASE_TAR=$CACHE/debian-bookworm-minbase.tar
mkdir -p "$CACHE"
if [ ! -f "$BASE_TAR" ] || [ ! -s "$BASE_TAR" ]; then
    rm -rf "$BASE_TAR" "$BASE_TAR.part"
    if mmdebstrap --quiet --variant=minbase --format=tar bookworm "$BASE_TAR.part" 2>"$WORK/mmdebstrap.log"; then
        mv "$BASE_TAR.part" "$BASE_TAR"
    else
        rm -rf "$BASE_TAR.part"
        echo "mmdebstrap failed ($(tail -1 "$WORK/mmdebstrap.log")); using a busybox base instead"
    fi
fi
if [ -f "$BASE_TAR" ] && [ -s "$BASE_TAR" ]; then
    ls -l "$BASE_TAR"
    BASE=$($LAYERCTL build "$BASE_TAR" --push --role base --json | tee /dev/stderr | field blob)
else
    mkdir -p "$WORK/base"/{bin,etc,tmp,root,proc,sys,dev,workspace}
    cp /bin/busybox "$WORK/base/bin/busybox"
    for app in $("$WORK/base/bin/busybox" --list); do [ "$app" = busybox ] || ln -s busybox "$WORK/base/bin/$app"; done
    echo "root:x:0:0:root:/root:/bin/sh" > "$WORK/base/etc/passwd"
    echo "root:x:0:" > "$WORK/base/etc/group"
    BASE=$($LAYERCTL build "$WORK/base" --push --all-root --role base --json | tee /dev/stderr | field blob)
fi

say "toolkit layer: a small tool"
mkdir -p "$WORK/toolkit/opt/toolkit/bin"
printf '#!/bin/sh\necho "toolkit says: $(ls /workspace | wc -l) entries in the workspace"\n' \
    > "$WORK/toolkit/opt/toolkit/bin/summary"
chmod 755 "$WORK/toolkit/opt/toolkit/bin/summary"
TOOLKIT=$($LAYERCTL build "$WORK/toolkit" --push --all-root --role toolkit --json | tee /dev/stderr | field blob)

say "workspace layer: this repository's source tree"
mkdir -p "$WORK/ws/workspace"
git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$WORK/ws/workspace")
WORKSPACE=$($LAYERCTL build "$WORK/ws" --push --all-root --role workspace --json | tee /dev/stderr | field blob)

say "environment demo:v1 = base + toolkit + workspace"
printf '{"cmd": ["/bin/sh"], "env": ["PATH=/opt/toolkit/bin:/bin"], "workdir": "/workspace"}' > "$WORK/config.json"
$LAYERCTL env create --base "$BASE" --toolkit "$TOOLKIT" --workspace "$WORKSPACE" \
    --config "$WORK/config.json" -t demo:v1 --json

say "run a sandbox lazily (the node daemon starts on first use)"
$LAYERCTL run demo:v1 -- sh -c 'cat /etc/debian_version 2>/dev/null; summary; head -3 /workspace/README.md; echo "python files: $(find /workspace -name "*.py" | wc -l)"'

say "what lazy loading fetched: only metadata and the files the sandbox read"
$LAYERCTL stats --cache "$NODE/cache"
$LAYERCTL stats --cache "$NODE/cache" --json | python3 -c '
import json, sys
blobs = json.load(sys.stdin)["blobs"]
size = sum(b["size"] for b in blobs.values())
fetched = sum(b["fetched_bytes"] for b in blobs.values())
print(f"fetched {fetched / 2**20:.1f} MiB of the environment'"'"'s {size / 2**20:.1f} MiB ({100 * fetched / size:.1f}%)")'


say "a sandbox writes, is committed as a new layer (demo:v2), and resumes from it"
$LAYERCTL run --keep --sandbox demo-1 demo:v1 -- sh -c 'echo "result of task 1" > /workspace/RESULT; rm /workspace/README.md'
$LAYERCTL commit demo-1 -t demo:v2 --json
$LAYERCTL sandbox rm demo-1
$LAYERCTL run demo:v2 -- sh -c 'cat /workspace/RESULT; test ! -e /workspace/README.md && echo "README.md stays deleted"'

say "the store"
$LAYERCTL store ls
$LAYERCTL store verify
