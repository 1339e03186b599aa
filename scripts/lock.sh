#!/usr/bin/env bash
# The project's locks, from one place:
#   scripts/lock.sh write [PACKAGE|all]  refresh uv.lock (upgrading PACKAGE, or every package) and
#                                        the files derived from it; `make lock` calls this
#   scripts/lock.sh check                exit 1 with one line if any lock no longer matches what it
#                                        is made from; `make test` calls this before installing
# uv.lock is uv's universal lock of pyproject.toml (runtime and every extra). Derived from it, for
# installers that are not uv: deploy/image/requirements*.txt (the Dockerfile's pip). Apart from it,
# from their own requirements.in: deploy/image/build-requirements.txt (what builds the wheel in the
# image), tests/fixtures/bounds/{lowest,newest}.txt (the runtime alone at the bottom and the top of
# the ranges pyproject.toml declares: `make test-bounds`) and tests/fixtures/mlserver/requirements.txt
# (MLServer's own venv in the tests: it pins numpy, fastapi and protobuf of its own, so it cannot
# share one environment with modelyard[dev]).
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-.tools/bin/uv}
mlserver_in=tests/fixtures/mlserver/requirements.in
mlserver_lock=tests/fixtures/mlserver/requirements.txt
build_in=deploy/image/build-requirements.in
build_lock=deploy/image/build-requirements.txt
bounds_in=tests/fixtures/bounds/requirements.in
lowest_lock=tests/fixtures/bounds/lowest.txt
newest_lock=tests/fixtures/bounds/newest.txt

# $1: the folder to write the derived files into; $2: uv's upgrade flags, if any. The exports are
# deterministic for a given uv.lock; the compiled locks keep the pins of the files already at $1
# (uv prefers them), so they move only when their requirements.in does, or when asked to upgrade.
derive() {
    local out=$1 upgrade=${2:-}
    mkdir -p "$out/deploy/image" "$out/tests/fixtures/mlserver" "$out/tests/fixtures/bounds"
    local header="# Exported from uv.lock by \`make lock\`: the image's pip installs exactly these."
    { echo "$header"; "$uv" export -q --frozen --no-dev --no-emit-project --no-header; } \
        >"$out/deploy/image/requirements.txt"
    { echo "$header"; "$uv" export -q --frozen --no-dev --no-emit-project --no-header --extra storage; } \
        >"$out/deploy/image/requirements-storage.txt"
    local compile=("$uv" pip compile -q $upgrade --generate-hashes --python-version 3.11
        --python-platform linux --custom-compile-command "make lock")
    "${compile[@]}" "$mlserver_in" -o "$out/$mlserver_lock"
    "${compile[@]}" "$build_in" -o "$out/$build_lock"
    "${compile[@]}" --resolution lowest-direct "$bounds_in" -o "$out/$lowest_lock"
    "${compile[@]}" "$bounds_in" -o "$out/$newest_lock"
}

case "${1:-}" in
write)
    case "${2:-}" in
    "") "$uv" lock; derive . ;;
    all) "$uv" lock --upgrade; derive . --upgrade ;;
    *) "$uv" lock --upgrade-package "$2"; derive . "--upgrade-package $2" ;;
    esac
    ;;
check)
    stale() { echo "$1 is out of date with pyproject.toml: run make lock" >&2; exit 1; }
    "$uv" lock --check -q 2>/dev/null || stale uv.lock
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    for file in "$mlserver_lock" "$build_lock" "$lowest_lock" "$newest_lock"; do  # the pins to keep
        mkdir -p "$tmp/$(dirname "$file")"
        cp "$file" "$tmp/$file" 2>/dev/null || true
    done
    derive "$tmp" 2>/dev/null || stale "the lock's derived files"
    for file in deploy/image/requirements{,-storage}.txt "$build_lock" "$mlserver_lock" "$lowest_lock" "$newest_lock"; do
        cmp -s "$tmp/$file" "$file" || stale "$file"
    done
    ;;
*)
    echo "usage: scripts/lock.sh write [PACKAGE|all] | check" >&2
    exit 2
    ;;
esac
