#!/usr/bin/env bash
# The checks that need a GPU, as one short command for a lent
# device machine (its python3 holds a CUDA torch and pytest):
#     bash tools/device_check.sh          # $OUT: where the results go
# 1. tests/cuda (the compiled path under inductor, CUDA graphs of the stacked
#    groups, a non-factor step without host synchronisation, ...) and a
#    campaign's snapshot resumed on the GPU;
# 2. the step-launches cost case on CUDA (kaisa bench run step-launches): a
#    non-factor step <= 1.15x the first-order step at factor/inverse
#    intervals 10/100 (its second table).  The arms take turns step by step
#    (rounds=100, block=1): the pool's machines drift within minutes, and
#    blocks of 20 steps moved the ratio by up to 0.1 (lm-2x128 on one H100,
#    the same code: 1.19 in blocks, 1.09 step by step).
# 3. what an exact skip of a NaN step costs there: step-cost's arms with the
#    verdict read every step (an unfused optimizer's exact skip, no replay)
#    and a fused SGD taking the verdict on the device, replayed;
# 4. the large-batch forecast with the step measured on the GPU.
# Every record written is packed into $OUT/records.tar.gz (the device tool
# returns files at most two folders down).
set -u
export PYTHONPATH="$PWD/src:$PWD/lab/src" PYTHONUNBUFFERED=1
OUT="${OUT:-runs/device}"
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/device.txt"
timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -p no:randomly -rsfP tests/cuda \
  tests/lab/test_snapshot.py::test_a_group_on_cuda_resumes_bit_for_bit \
  2>&1 | tail -80 | tee "$OUT/cuda_tests.txt"
timeout "${BENCH_S:-240}" python3 -m kaisa_lab bench run step-launches --device cuda \
  --option device=cuda --option rounds=100 --option block=1 --records "$OUT/records" \
  2>&1 | tee "$OUT/step_launches.txt" | grep -E '^\||Error'
timeout "${SKIP_S:-120}" python3 -m kaisa_lab bench run step-cost --device cuda \
  --option device=cuda --option reference_src=null --option 'models=["mlp-784-512-512-10"]' \
  --option 'variants=["sgd", "kfac eigen f=10 inv=100", "kfac eigen f=10 inv=100 replayed", "kfac eigen f=10 inv=100 read", "sgd fused", "kfac eigen f=10 inv=100 fused replayed"]' \
  --records "$OUT/records" 2>&1 | tee "$OUT/step_cost_skip.txt" | grep -E '^\||Error'
timeout "${FORECAST_S:-120}" python3 -m kaisa_lab bench run large-batch-forecast --device cuda \
  --option device=cuda --option "records=$PWD/benchmarks/records" --records "$OUT/records" \
  2>&1 | tee "$OUT/forecast.txt" | grep -E '^\||^Per-rank|^Step|Error'
tar -czf "$OUT/records.tar.gz" -C "$OUT" records 2>/dev/null
