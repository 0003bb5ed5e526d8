#!/usr/bin/env bash
# The GPU checks for a machine with one CUDA GPU, everything measured as on a CPU, run from the
# repository root; at most 9.5 minutes (the caps of its pieces add up to that), so that it fits one
# 10-minute command of a short GPU lease:
#
#     bash scripts/gpu_check.sh [OUT_DIR [PIECE...]]   # default /tmp/gpu_check, every piece
#     GPU_CHECK_QUICK=1 bash scripts/gpu_check.sh      # tiny shapes and 2 steps: does every piece run?
#
# In order, each under a timeout (a cap, not the expected time), its output in OUT_DIR/NAME.txt and
# its exit status in OUT_DIR/NAME.rc (124: timed out), a failed piece not stopping the next:
#   test_gpu    tests/test_gpu.py (fp16 training, which needs a GPU)
#   bench1-3    scripts/bench.py at 3 shapes, autocast: fathom, bf16-weights, torchscale, engine (bf16)
#   profile     scripts/bench.py --profile at branchnorm_500L.json's model, 100L-100L: the plain loop,
#               the engine, and the engine with its layers replayed from CUDA graphs
#   train500    ds_configs/branchnorm_500L.json at one stage for 4 steps, with train.cuda_graphs
# then one markdown table of what OUT_DIR holds (scripts/bench.py --summarize OUT_DIR). Naming pieces
# runs those alone, into the same OUT_DIR: a second call for what the first one's caps cut off.
set -uo pipefail

OUT=${1:-/tmp/gpu_check}
PIECES=("${@:2}")
if ! python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "gpu_check.sh: torch sees no CUDA GPU here; run it on a machine with one" >&2
    exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then
    TESTS=(-k nonfinite_loss)
    SHAPES=("--layers 2 --dim 64 --ffn 256 --heads 4 --batch 8" "--layers 4 --dim 64 --ffn 256 --heads 4 --batch 4")
    SIZE="--vocab 1000 --src-len 16 --tgt-len 16 --matmul-sizes 1024"
    STEPS="--warmup 1 --steps 2 --rounds 1"
    PROFILE="--layers 4 --dim 32 --ffn 64 --heads 2"
    TRAIN=(model.encoder_layers=4 model.decoder_layers=4 train.max_steps=2)
else
    TESTS=()
    SHAPES=(
        "--layers 6 --dim 512 --ffn 2048 --heads 8 --batch 128"
        "--layers 48 --dim 512 --ffn 2048 --heads 8 --batch 64"
        "--layers 6 --dim 1024 --ffn 4096 --heads 16 --batch 128"
    )
    # 2048^2 matmuls are far from a datacenter GPU's peak; these reach it.
    SIZE="--vocab 32000 --src-len 64 --tgt-len 64 --matmul-sizes 4096,8192"
    STEPS="--warmup 2 --steps 4 --rounds 1"
    PROFILE="--layers 100 --dim 128 --ffn 512 --heads 4"
    # 4 steps: the engine took about 20 s a step on an H100 without graphs (docs/BENCHMARKS.md); the
    # summary's median leaves out the first two.
    TRAIN=(train.max_steps=4)
fi
# the 500L run's layers replayed from CUDA graphs; every micro-batch one shape (sentences of up to 7
# tokens with eos): one graph per layer
GRAPHS=(train.cuda_graphs=true data.pad_to_multiple=8)

COMPARE=bf16-weights,torchscale,deepspeed
if ! python -c 'from fathom.tools.torchscale_peer import import_torchscale; import_torchscale()' 2>/dev/null; then
    echo "gpu_check.sh: torchscale is not importable (make peers): the benches leave it out" >&2
    COMPARE=bf16-weights,deepspeed
fi

selected() {  # NAME
    [ ${#PIECES[@]} -eq 0 ] || [[ " ${PIECES[*]} " == *" $1 "* ]]
}

piece() {  # NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    selected "$name" || return 0
    echo "== $name: $*"
    timeout --kill-after=15 "$seconds" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "${PIPESTATUS[0]}" >"$OUT/$name.rc"
}

# The tests each launch their own run on a free port: side by side where pytest-xdist is installed.
if python -c 'import xdist' 2>/dev/null; then TESTS+=(-n 3); fi
piece test_gpu 170 python -m pytest -m gpu tests/test_gpu.py -q "${TESTS[@]}"

shape=0
for args in "${SHAPES[@]}"; do
    shape=$((shape + 1))
    # shellcheck disable=SC2086  # the shapes are words
    piece "bench$shape" 45 python scripts/bench.py $args $SIZE $STEPS --device cuda --precision autocast \
        --compare "$COMPARE" --scheme deepnorm --share-all-embeddings \
        --json "$OUT/bench$shape.json"
done

# branchnorm_500L.json's model and micro-batches (8 pairs of up to 6 tokens, its synthetic task's 16
# words and 4 special symbols), 4 of them a step; bf16: the plain loop under autocast, the engine bf16;
# the graphed engine's warmup step records the graphs.
# shellcheck disable=SC2086
piece profile 150 python scripts/bench.py --profile $PROFILE --vocab 20 --scheme branchnorm --batch 8 \
    --src-len 6 --tgt-len 6 --micro-batches 4 --checkpoint-interval 1 --device cuda --precision bf16 \
    --systems plain,engine,engine-graphed --warmup 1 --steps 2 --rounds 1 --json "$OUT/profile.json"

# train.save_interval past max_steps: only the final save, which a run always makes.
if selected train500; then rm -rf "$OUT/run500"; fi
piece train500 115 deepspeed --num_gpus 1 scripts/train.py --config ds_configs/branchnorm_500L.json \
    --override pipeline.stages=1 "${TRAIN[@]}" "${GRAPHS[@]}" train.save_interval=1000 \
    "train.save_dir=$OUT/run500" train.log_interval=1

python scripts/bench.py --summarize "$OUT" | tee "$OUT/summary.md"
