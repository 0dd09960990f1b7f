#!/usr/bin/env bash
# Device work longer than one device call (10 minutes at most; a warm machine waits 30 s for the
# next call): start it detached in one call, wait on it in the next ones.
#   bash gpu_checks/background.sh start NAME CMD...  # detached; its $OUT is /root/bg/NAME/out
#   bash gpu_checks/background.sh wait NAME SECONDS  # until NAME ends or SECONDS pass
# `wait` prints the log's tail and packs NAME's files into this call's $OUT/NAME.tgz once it has
# ended, or what it has so far into $OUT/NAME.partial.tgz (a call brings back a few files only).
# CMD runs in a private copy of this call's tree (NAME/tree; carried pieces in .packs are left
# out): every device call replaces the repository's files, and a job that imported a module while
# the next call's `wait` was replacing them failed (session 14). The commit it ran at is in
# NAME/commit.
set -uo pipefail
BG=/root/bg
action=${1:?start|wait}; name=${2:?job name}; shift 2
dir=$BG/$name
# Packs leave weights out: a pack holding a bench's random models was refused for size (session 22);
# and checkpoints (a trainer's run folders hold them: a 0.5B policy's with its optimizer is GBs).
NO_WEIGHTS=(--exclude=./work --exclude="*.safetensors" --exclude="*.bin" --exclude=checkpoints
            --exclude="*.distcp" --exclude="*.pt")
case $action in
  start)
    if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
      echo "$name is still running (pid $(cat "$dir/pid"))"; exit 1
    fi
    rm -rf "$dir"; mkdir -p "$dir/out" "$dir/tree"
    # YATT_COMMIT first: the device machine's .git HEAD can be stale (session 16's jobs named
    # the session's first commit); git's HEAD otherwise.
    echo "${YATT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" >"$dir/commit"
    tar -cf - --exclude=./.packs . | tar -xf - -C "$dir/tree"
    # setsid: the job outlives this call's shell; its rc file marks the end.
    (cd "$dir/tree" && OUT=$dir/out setsid nohup bash -c '"$@"; echo $? >"'"$dir"'/rc"' _ "$@" \
      >"$dir/log" 2>&1 </dev/null &
     echo $! >"$dir/pid")
    echo "started $name (pid $(cat "$dir/pid")) at commit $(cat "$dir/commit")" ;;
  wait)
    limit=${1:?seconds}
    [ -d "$dir" ] || { echo "no job $name"; exit 1; }
    start=$SECONDS
    while [ ! -f "$dir/rc" ] && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 5; done
    tail -n "${TAIL_LINES:-60}" "$dir/log"
    # A trainer run's own log (the off-policy bench writes out/s*/trainer.log as it goes): the
    # newest one's tail, so a long first step shows what it is doing (session 24).
    newest=$(ls -t "$dir"/out/*/trainer.log 2>/dev/null | head -n 1)
    if [ -n "$newest" ]; then
      echo "--- ${newest#"$dir"/out/} (tail)"; tail -n "${TRAINER_TAIL_LINES:-15}" "$newest" | cut -c1-400
    fi
    if [ -f "$dir/rc" ]; then
      echo "=== $name ended rc=$(cat "$dir/rc") (commit $(cat "$dir/commit"))"
      cp "$dir/log" "$dir/out/$name.log"
      tar czf "${OUT:?}/$name.tgz" "${NO_WEIGHTS[@]}" -C "$dir/out" .
    else
      echo "=== $name still running after ${limit}s"
      # what it has written so far: a machine taken back mid-job loses nothing already done
      cp "$dir/log" "$dir/out/$name.log"
      tar czf "${OUT:?}/$name.partial.tgz" "${NO_WEIGHTS[@]}" -C "$dir/out" .
    fi ;;
  *) echo "usage: $0 start|wait NAME ..."; exit 2 ;;
esac
