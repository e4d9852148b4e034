#!/usr/bin/env bash
# A campaign worker for long time-to-target campaigns on a shared machine.
#
#   tools/campaign_worker.sh NAME [STATE_DIR]
#
# Loops until STATE_DIR/STOP exists: takes the first case named in
# STATE_DIR/NAME.cases (one line, cases separated by spaces, in the order to
# run them) that has work left and runs one lockstep group of it
# (`kaisa bench run CASE --max-units 1 --no-wait`), then reads the list again,
# so a new order or a new pin takes effect at the next group.
#
# Each case runs from the commit pinned in STATE_DIR/COMMIT.CASE (a git
# worktree under STATE_DIR/wt/, made on first use), so every run of a
# campaign trains with the same code while the checkout moves on; the records
# go to this checkout's benchmarks/records.  Several workers share the work
# (each group is claimed by a lock file; a dead worker's lock is taken over,
# and its group resumes from its last snapshot).  Default STATE_DIR:
# $KAISA_CAMPAIGN_DIR, else ./runs/campaign; records: $KAISA_CAMPAIGN_RECORDS,
# else this checkout's benchmarks/records.  Uses this checkout's .venv.
set -u
name=${1:?usage: tools/campaign_worker.sh NAME [STATE_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
state=${2:-${KAISA_CAMPAIGN_DIR:-$root/runs/campaign}}
state=$(mkdir -p "$state" && cd "$state" && pwd)  # absolute: worktrees are added from $root
records=${KAISA_CAMPAIGN_RECORDS:-$root/benchmarks/records}
log=$state/worker-$name.log
python=$root/.venv/bin/python
mkdir -p "$state/wt"
while [ ! -f "$state/STOP" ]; do
  for case in $(cat "$state/$name.cases"); do
    [ -f "$state/STOP" ] && break
    commit=$(cat "$state/COMMIT.$case")
    tree=$state/wt/$commit
    if [ ! -d "$tree" ]; then
      flock "$state/wt.lock" git -C "$root" worktree add --detach "$tree" "$commit" >> "$log" 2>&1
    fi
    echo "$(date -u +%FT%T) $name: $case @ $commit" >> "$log"
    out=$(cd "$tree" && PYTHONPATH=src:lab/src "$python" -m kaisa_lab bench run "$case" \
      --records "$records" --threads 1 --no-wait --max-units 1 2>&1 | tee -a "$log")
    # a group was run: start again from the first case of the (re-read) list
    if grep -q "run(s) in lockstep" <<< "$out"; then
      continue 2
    fi
  done
  sleep 60
done
echo "$(date -u +%FT%T) $name: stopped" >> "$log"
