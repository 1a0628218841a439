#!/usr/bin/env bash
# Before/after, side by side: the engine benchmarks at an earlier commit (a git worktree of BASE,
# default 7e3e15f, the tree before the ort-contrib default) and at this checkout, alternating
# base, here, base, here so both see the same background. Run from the repository root with
# Node >= 22 on PATH; prefix with `chrt -r 10` (as root) on a shared machine. Logs go to OUT.
#   bash reproduction/ab-engine.sh [BASE] [OUT]
set -euo pipefail
base_rev=${1:-7e3e15f}
out=${2:-$(mktemp -d)}
here=$(pwd)
base_dir=$(mktemp -d)
git worktree add -q --detach "$base_dir" "$base_rev"
ln -s "$here/node_modules" "$base_dir/node_modules"
trap 'git -C "$here" worktree remove --force "$base_dir"' EXIT
uptime > "$out/load-start"
for rep in 1 2; do
  for side in base here; do
    dir=$here; [ "$side" = base ] && dir=$base_dir
    (cd "$dir" && node reproduction/bench-engine.ts --sizes 60m --quants int4,none --reps 3 --health 500 > "$out/engine-$side-$rep.log" 2>&1)
    (cd "$dir" && node reproduction/bench-batching.ts --sizes 60m --ragged 12 --streams 1,8 --rounds 1 --modes batched,serial > "$out/batching-$side-$rep.log" 2>&1)
  done
done
uptime > "$out/load-end"
echo "logs in $out"
