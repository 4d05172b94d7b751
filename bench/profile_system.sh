#!/usr/bin/env bash
# Where the time goes in the whole async GRPO system on one GPU: trains configs/sums_gpu.yaml (SmolLM2-135M-Instruct,
# two-digit sums, learner and engine sharing the GPU) for STEPS steps and, once training runs, samples every actor
# process and the driver with py-spy for PROFILE_S seconds (collapsed stacks, `-f raw`). Output in $OUT:
#   train_<engine>.log, metrics_<engine>.jsonl, pyspy_<engine>_<Actor>.txt, top_<engine>.txt (summary)
#
#   ENGINE=torch STEPS=60 bash bench/profile_system.sh      (needs py-spy, Ray and the smollm2 alias on the machine)
set -uo pipefail
case ${1:-} in -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;; esac
out=${OUT:-/tmp/out}; steps=${STEPS:-60}; engine=${ENGINE:-torch}; secs=${PROFILE_S:-20}
shift 0
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
run_dir=/tmp/sums_$engine
rm -rf "$run_dir"
python3 -m rlasync train configs/sums_gpu.yaml --set max_steps="$steps" --set output_dir="$run_dir" \
    --set cluster.engine="$engine" "$@" > "$out/train_$engine.log" 2>&1 &
driver=$!
for _ in $(seq 1 300); do [ -s "$run_dir/metrics.jsonl" ] && break; kill -0 $driver 2>/dev/null || break; sleep 1; done
sleep 3
pids=()
for name in RolloutActor GenerationActor LearnerActor QueueActor; do
    p=$(pgrep -f "ray::$name" | head -1)
    if [ -n "$p" ]; then
        py-spy record -d "$secs" -r 100 -f raw -p "$p" -o "$out/pyspy_${engine}_$name.txt" > /dev/null 2>&1 &
        pids+=($!)
    fi
done
py-spy record -d "$secs" -r 100 -f raw -p "$driver" -o "$out/pyspy_${engine}_driver.txt" > /dev/null 2>&1 &
pids+=($!)
wait "${pids[@]}"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$out/train_$engine.log" 2>&1
wait $driver
echo "train rc $?"
cp "$run_dir/metrics.jsonl" "$out/metrics_$engine.jsonl" 2>/dev/null
python3 bench/pyspy_top.py "$out"/pyspy_"${engine}"_*.txt > "$out/top_$engine.txt" 2>&1
tail -n 3 "$out/train_$engine.log"
