#!/usr/bin/env bash
# A queue of GPU jobs that outlives one 10-minute device call, and hands back what it has after every call.
#
#   bash scripts/gpu_queue.sh start FILE      # run FILE's jobs one after another in the background (one job a line:
#                                             # a shell command, run from the checkout with OUT set to its own folder)
#   bash scripts/gpu_queue.sh wait SECONDS    # print the summary as jobs end, until the queue is done or SECONDS pass;
#                                             # then pack everything so far (logs, results) into $OUT/queue.tgz
#   bash scripts/gpu_queue.sh status          # the summary so far
#   bash scripts/gpu_queue.sh stop            # stop the queue and its running job
#
# Why: the GPU machine stays up only ~30 s between calls, and a queue's files exist only on it. A call that ends
# with `wait` brings back what finished so far, so a machine lost between calls (a late reply) costs only the job it
# was running, not the whole queue (run 19 lost a finished Gemma-2 bench that way). Chain calls back to back:
#   call 1 (carry .gpu/a):                      bash .gpu/a/stage.sh
#   call 2 (carry .gpu/apart):                  source .gpu/apart/install.sh   (with .gpu/b: over 64 MiB)
#   call 3 (carry .gpu/b):                      source .gpu/b/activate.sh &&
#                                               bash scripts/gpu_queue.sh start scripts/gpu_queues/next.txt &&
#                                               bash scripts/gpu_queue.sh wait 540
#   calls 4.. (no carry):                       bash scripts/gpu_queue.sh wait 570  (exit 3 at once on a bare machine)
# Then unpack queue.tgz, copy the records under */benchmarks/results/ into benchmarks/results/, run
# `python scripts/bench_tables.py`, and write what the tests showed into tests/gpu/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
Q=${GPU_QUEUE_DIR:-/tmp/gpu-queue}
summary="$Q/summary.txt"

case "${1:-}" in
start)
    file=${2:?usage: gpu_queue.sh start FILE}
    [ -f "$file" ] || { echo "gpu_queue.sh: no queue file $file" >&2; exit 2; }
    # a queue still running keeps its folder: starting over it deleted a running job's files (run 37)
    if [ -f "$Q/pid" ] && kill -0 "$(cat "$Q/pid")" 2>/dev/null; then
        echo "gpu_queue.sh: a queue is still running at $Q ($(grep -c '] job .*: exit' "$summary") jobs done):" \
            "\`wait\` for it, or \`stop\` it first" >&2
        exit 4
    fi
    rm -rf "$Q" && mkdir -p "$Q"
    cp "$file" "$Q/jobs.txt"
    # shellcheck disable=SC2016
    setsid nohup bash -c '
        Q=$1; summary=$Q/summary.txt; n=0
        [ -f /tmp/gpu-env.sh ] && source /tmp/gpu-env.sh
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
        echo "[$(date -u +%H:%M:%S)] queue started: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
            >> "$summary"
        while IFS= read -r job; do
            case "$job" in "" | "#"*) continue ;; esac
            n=$((n + 1)); start=$SECONDS
            mkdir -p "$Q/$n"
            echo "[$(date -u +%H:%M:%S)] job $n: $job" >> "$summary"
            OUT="$Q/$n" bash -c "$job" > "$Q/$n/log.txt" 2>&1
            rc=$?
            last=$(grep -E "(passed|failed|error|skipped|wrote)" "$Q/$n/log.txt" | tail -n 1 | cut -c1-200)
            echo "[$(date -u +%H:%M:%S)] job $n: exit $rc after $((SECONDS - start)) s; ${last}" >> "$summary"
        done < "$Q/jobs.txt"
        echo "[$(date -u +%H:%M:%S)] QUEUE DONE" >> "$summary"
    ' _ "$Q" > "$Q/queue.log" 2>&1 < /dev/null &
    echo $! > "$Q/pid"
    sleep 2
    cat "$summary" 2>/dev/null
    ;;
wait)
    seconds=${2:?usage: gpu_queue.sh wait SECONDS}
    # a machine lost between calls comes back bare: say so at once instead of holding it for SECONDS
    [ -f "$summary" ] || { echo "gpu_queue.sh: no queue at $Q (a fresh machine: the queue went with the last one)" >&2; exit 3; }
    shown=0
    deadline=$((SECONDS + seconds))
    while ((SECONDS < deadline)); do
        lines=$(wc -l < "$summary" 2>/dev/null || echo 0)
        if ((lines > shown)); then
            tail -n +$((shown + 1)) "$summary"
            shown=$lines
        fi
        grep -q "QUEUE DONE" "$summary" 2>/dev/null && break
        sleep 5
    done
    # one archive: what comes back from the device machine is at most 8 files, 2 folders down, 16 MiB each; files
    # over 4 MiB (profiler traces) stay behind and are listed
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && (cd "$Q" && find . -type f -size -4M | tar czf "$OUT/queue.tgz" -T -)
        cp "$summary" "$OUT/summary.txt"
        left=$(cd "$Q" && find . -type f -size +4M -printf '%p ')
        echo "packed $(du -sh "$Q" | cut -f1) into \$OUT/queue.tgz${left:+; left behind (over 4 MiB): $left}"
    fi
    ;;
status)
    cat "$summary" 2>/dev/null || echo "no queue at $Q"
    ;;
stop)
    # the queue and its running job (its own session: setsid)
    [ -f "$Q/pid" ] && kill -- -"$(cat "$Q/pid")" 2>/dev/null
    echo "[$(date -u +%H:%M:%S)] stopped" >> "$summary"
    ;;
*)
    echo "usage: bash scripts/gpu_queue.sh start FILE | wait SECONDS | status | stop" >&2
    exit 2
    ;;
esac
