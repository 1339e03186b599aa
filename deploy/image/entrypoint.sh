#!/bin/sh
# The image's entrypoint: `modelyard ARGS`. KServe starts its router image with only
# `--graph-json <spec>`; given that, run the graph router, so this image can replace KServe's
# router image (inferenceservice-config, key "router") with no other change.
set -e
case "$1" in
    --graph-json|--graph-json=*) exec modelyard graph serve "$@" ;;
esac
exec modelyard "$@"
