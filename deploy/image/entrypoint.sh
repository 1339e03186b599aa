#!/bin/sh
# The image's entrypoint: `modelyard ARGS`. KServe starts its router image with flags only
# (`--graph-json <spec>`, and `--inferencegraph-name N` in newer releases); given flags with
# --graph-json among them, run the graph router, so this image can replace KServe's router image
# (inferenceservice-config, key "router") with no other change.
set -e
case "$1" in
    -*)
        for arg in "$@"; do
            case "$arg" in
                --graph-json|--graph-json=*) exec modelyard graph serve "$@" ;;
            esac
        done ;;
esac
exec modelyard "$@"
