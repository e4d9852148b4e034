#!/usr/bin/env bash
# text-lm-large's time to target on a lent GPU, as one command:
#     bash tools/device_ttt.sh          # $OUT: where the results go
# The held-out seeds of ARMS (default: AdamW, Muon, the fastest first-order
# arm and the fastest K-FAC arm of the CPU campaign's held-out records,
# kaisa_lab.bench.advice.compared_arms; before text-lm-large is held out,
# AdamW, Muon and Muon + K-FAC at the defaults and on Muon's AdamW part only)
# at the settings the CPU campaign in benchmarks/records selected (kaisa bench run --selected-from: the whole
# protocol does not fit a device session), into $OUT/records, then the
# held-out table of what finished; every arm's model compiled (COMPILE=
# runs them eager). Runs that finish before the timeout are kept; carry them
# back as --records to go on where it stopped.
set -u
export PYTHONPATH="$PWD/src:$PWD/lab/src" PYTHONUNBUFFERED=1
OUT="${OUT:-runs/device}"
CHOSEN=$(python3 -c "
from kaisa_lab.bench.advice import compared_arms
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import RecordStore
arms = compared_arms(Campaign(get_case('text-lm-large'), RecordStore('benchmarks/records')))
print(','.join(arms or ['adamw', 'muon', 'muon+kfac', 'muon+kfac-adamw-part']))")
ARMS="${ARMS:-$CHOSEN}"
echo "arms: $ARMS"
# every arm's model compiled (K-FAC's statistics inside the graphs, a factor
# step launch-light); COMPILE= runs them eager
COMPILE="${COMPILE-inductor}"
COMPILED=${COMPILE:+--compile-model $COMPILE}
RECORDS="${RECORDS:-$OUT/records}"
mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$OUT/device.txt"
timeout "${TTT_S:-480}" python3 -m kaisa_lab bench run text-lm-large --device cuda \
  --selected-from benchmarks/records --records "$RECORDS" --arms "$ARMS" $COMPILED \
  --snapshot-minutes 0 --no-wait 2>&1 | tail -40 | tee "$OUT/ttt.txt"
python3 -m kaisa_lab bench report text-lm-large --records "$RECORDS" \
  --selected-from benchmarks/records $COMPILED 2>&1 | tee "$OUT/ttt_report.md"
tar -czf "$OUT/ttt_records.tar.gz" -C "$RECORDS" . 2>/dev/null
