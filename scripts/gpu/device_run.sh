#!/bin/bash
# One GPU run (see scripts/gpu/README.md): CUDA engine checks, then the drafter at scale.
# Reads the packed target from STAGE (parts sent by earlier calls, plus .gpu/ of this call);
# writes at most 8 files to $OUT: log.txt, engine.tgz, drafter.tar.* (drafter + generated corpus).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET=${BUDGET:-500}
STAGE=/tmp/stage
RES=/tmp/res
mkdir -p $STAGE $RES/engine
exec > >(tee $OUT/log.txt) 2>&1
cp .gpu/final/* $STAGE/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, numpy; print(torch.__version__, transformers.__version__, numpy.__version__)"
T=/tmp/target/smollm2-135m-instruct
python3 scripts/gpu/unpack_weights.py $STAGE $T || exit 1
echo "== unpacked at $(( $(date +%s) - START ))s"
[ "${PASS_COST:-1}" = 1 ] && timeout 40 python3 -m builder.cli.main bench pass-cost --device cuda --target $T --batch 1,4,16 \
  --sizes 1,4,8 --repeats 2 --label gpu-h200 --out $RES/engine --headline $RES/engine/headline-gpu.json
echo "== pass cost done at $(( $(date +%s) - START ))s"
[ -n "${CUDA_BENCH:-}" ] && timeout 60 python3 -m builder.cli.main bench --device cuda --target $T --eagle artifacts/smollm2-135m-eagle3 \
  --prompts-per-workload 1 --repeats 1 --max-tokens ${BENCH_TOKENS:-64} --label gpu-h200 --out $RES/engine \
  --headline $RES/engine/headline-gpu.json
echo "== bench done at $(( $(date +%s) - START ))s"
tar czf $OUT/engine.tgz -C $RES engine
[ "${DRAFTER:-1}" = 1 ] && python3 scripts/gpu/eagle3_at_scale.py --target $T --out $RES/scale --device cuda --tf32 \
  --gen-s ${GEN_S:-100} --skip-batches ${SKIP_BATCHES:-0} --train-s 400 --finish-by $(( START + BUDGET - 15 )) --eval-every-s 45
echo "== drafter done at $(( $(date +%s) - START ))s"
[ -d $RES/scale ] && tar cf - -C $RES scale | split -b 15M - $OUT/drafter.tar.
ls -la $OUT
