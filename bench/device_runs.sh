#!/usr/bin/env bash
# The GPU measurements still owed, as two device calls made back to back (the second within 30 s of the first, so
# the machine stays warm and /tmp/site keeps Ray). Everything lands in $OUT; copy the JSON into bench/results/.
#
#   call 1  carry [".devicekit"]:  bash bench/device_runs.sh torch       (~10 min on nvidia-h200-x2)
#   call 2  carry [".vllmkit"]:    bash bench/device_runs.sh vllm        (~7 min)
#   (or)    carry []:               bash bench/device_runs.sh distill     (~3 min; on-policy distillation e2e)
#   (or)    carry [".devicekit"]:  bash bench/device_runs.sh onegpu      (~9 min on nvidia-h200: GPU tests, IPC GRPO, 1-GPU distillation)
#
# The kits are git-ignored folders built on the workstation: .devicekit (wheels of Ray and the pure-Python deps the GPU
# image lacks, with pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
# math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2), .vllmkit (vLLM 0.25 and its
# deps, with an unpack.sh), .trlwheel (TRL 1.16's wheel), and the SmolLM2 GGUF in two halves (.smol1, .smol2).
#
# Owed on one H200, in this order (each within 30 s of the one before, so /tmp/site stays):
#   carry [".devicekit"]           learner_varlen       (~8 min: varlen GPU tests, varlen vs flex at 8K rows, profile)
#   carry []                       learner_varlen_e2e   (~6 min: 4K A/B, GRPO with the learner on varlen)
#   carry []                       sampler_system       (~4 min: compiled vs eager sampler inside GRPO)
#   carry [".vllmkit", ".whl"]     vllm_recheck         (~8 min: both engines 256x256, py-spy of vLLM's sync)
#   carry [".devicekit"]           learner_tiles        (~8 min: FlexAttention tiles on a real row, the learner with the best)
#   (all five ran on 2026-12-02; bench/results.)
# Ran on 2026-12-03 (one H200, 15 min of device time): carry [".devicekit"] e2e_grpo --steps 20 (TorchEngine, IPC),
#   then carry [".vllmkit", ".whl"] STEPS=20 GRPO_ONLY=1 vllm_sync, then [".smol1"], then [".smol2"] with STEPS=200
#   system_torch's system and engine runs (bench/results/system_throughput_h200.json, e2e/*_gcfreeze_*).
#   .devicekit must hold the pydantic and math-verify wheels listed above: a kit without them fails at import.
#   Then [".devicekit"], [".vllmkit"] (unpack.sh), [".smol1"], [".smol2"] with vllm_sums (08:03 UTC).
# Ran on 2026-12-03 11:56-12:28 UTC (one H200, ~19 min): the cascade attention's GPU tests, kernels and learner A/B
#   (a stage since removed with the cascade, commit f4c6708), `python3 bench/attention_parts.py`, then
#   AB=1 learner_host and learner_host again (carry [".devicekit", ".whl"]): bench/results/attention_parts_h200.json,
#   tree_packing_h200.json (learner_2026_12_03_utc), profiles/learner_pyspy_tree_p544_c128_g8_row8192.txt.
# Ran on 2026-12-04 11:49-12:21 UTC (one H200, 29 of 30 device minutes): flash_kit + learner_flash, learner_rows,
#   learner_static, learner_full, learner_headdyn, learner_trl8k (bench/results/tree_packing_h200.json, key
#   learner_2026_12_04_utc and the headline; flex_flash_h200.json; profiles/tree_p544_c128_g8_row8192_full_2026_12_04*).
#   .pydkit holds pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 (all the
#   learner benches need besides the GPU image).
# Ran on 2026-12-04 14:55-15:01 UTC (one H200, ~6 device minutes): learner_agree plus the model and learner-rows GPU
#   tests (19 passed), then the 24-sample agreement command at seeds 0-2 (key bf16_logprob_agreement).
# Still owed: the TorchEngine's one slow pause early in GRPO (450 ms at step 4) profiled.
set -uo pipefail
stage=${1:?usage: bench/device_runs.sh STAGE (see the case below)}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, keep going on failure
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   rc $? ($(date +%T))"
    tail -n 4 "$out/$name.log"
}
use_pydkit() {  # pydantic and its three wheels (.pydkit) into /tmp/site, once per warm machine; the repo and it on PYTHONPATH
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .pydkit/*.whl || return 1
    export PYTHONPATH=$PWD:/tmp/site
}
case $stage in
torch)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/gpu tests/unit/engine/test_torch_engine_cuda.py tests/unit/learner/test_distill_step.py
    run weight_sync 150 python3 bench/weight_sync.py --rounds 3 --bucket-mb 256 --out "$out/weight_sync_h200.json"
    run e2e_torch 150 python3 bench/e2e_grpo.py --steps 10 --runs async --out "$out/e2e_torch.json"
    ;;
onegpu)  # one H200: GPU tests, GRPO with learner and engine sharing the GPU over CUDA IPC, distillation on one GPU
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/gpu tests/unit/engine/test_torch_engine_cuda.py tests/unit/learner/test_distill_step.py
    run e2e_ipc 170 python3 bench/e2e_grpo.py --steps 10 --runs async --share-gpu --weight-sync-backend ipc --out "$out/e2e_ipc_h200.json"
    run e2e_distill_1gpu 170 python3 bench/e2e_grpo.py --steps 10 --runs async --trainer distill --share-gpu --out "$out/e2e_distill_h200.json"
    ;;
distill)  # no carry needed if it follows the torch stage while the machine is warm (/tmp/site has Ray)
    [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run e2e_distill 300 python3 bench/e2e_grpo.py --steps 10 --runs async --trainer distill --out "$out/e2e_distill.json"
    ;;
system_torch)  # one H200, after the two calls that carry SmolLM2 (.smol1, .smol2): GPU engine tests, the system, the engine alone
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
engine_async)  # no carry: the built-in engine's CUDA tests (async scheduling included) and async vs sync throughput
    export PYTHONPATH=$PWD
    run engine_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_torch_engine_cuda.py
    run engine_async 240 python3 bench/engine_throughput.py --no-hf --async-scheduling compare --out "$out/engine_async_h200.json"
    ;;
vllm_speed)  # after a call that ran `bash .vllmkit/unpack.sh`: both engines, 256 x 256 -> 256 in one run; LoRA GRPO with vLLM
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run vllm_speed 300 python3 bench/vllm_check.py --out "$out/vllm_speed" --budget-s 240 --skip-server --engine-mode default --skip-phases correctness,weight_sync
    run e2e_lora_vllm 240 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --lora-rank 32 --engine vllm --out "$out/e2e_lora_vllm.json"
    ;;
final)  # one call, carry [".devicekit", ".whl", ".trlwheel"]: new CUDA paths' tests, the learner against TRL, GRPO sync, LoRA
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run gpu_tests 60 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/model/test_head_devices.py tests/unit/engine/test_weight_plans.py
    grep -q "failed" "$out/gpu_tests.log" && export RLASYNC_HEAD_COMPILE=0 && echo "head compile off"
    run tree_trl 270 python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 140 --shapes 1088x256x8@4096,544x128x8@8192 --groups 8 --steps 6 --warmup 2 --compile layers --grad-ckpt auto --modes tree --profile "$out/profiles" --profile-steps 2 --out "$out/tree_packing_h200.json"
    run e2e_ipc 150 python3 bench/e2e_grpo.py --steps 10 --runs async --share-gpu --weight-sync-backend ipc --out "$out/e2e_ipc_h200.json"
    run lora_sync 50 python3 bench/lora_sync.py --skip-vllm --out "$out/lora_h200.json"
    ;;
trl_only)  # carry [".devicekit", ".trlwheel"]: TRL's tree packing alone (bench/trl_tree_anchor.py), the shapes of `final`
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    mkdir -p /tmp/trlsite && python3 -m pip install -q --no-index --no-deps --target /tmp/trlsite .trlwheel/trl-*.whl
    export PYTHONPATH=/tmp/trlsite:$PWD:/tmp/site  # rlasync's imports need pydantic from the kit
    run trl 230 python3 bench/trl_tree_anchor.py --out "$out/trl.json" --shapes 1088x256x8@4096,544x128x8@8192 --groups 8 --steps 6 --warmup 2
    ;;
learner_tune)  # carry [".devicekit"] (for pydantic): the learner's knobs on the 8K shape (one H200): a profile and bf16 agreement, autotuned and graphed layers
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto"
    run tune_base 170 $tp --compile layers --modes tree,padding_free --profile "$out/profiles" --profile-steps 2 --out "$out/tune_base.json"
    run tune_autotune 230 $tp --compile layers --modes tree --prepare-kwargs '{"compile_mode": "max-autotune-no-cudagraphs"}' --out "$out/tune_autotune.json"
    run tune_graphs 150 $tp --compile layers --modes tree --prepare-kwargs '{"compile_mode": "reduce-overhead"}' --out "$out/tune_graphs.json"
    ;;
learner_tiles)  # carry [".devicekit"]: FlexAttention tile configurations on a real 8K tree row (bench/flex_tiles.py), then
    # the learner bench at 8K rows with torch's tiles and with the sweep's fastest fwd+bwd configuration, same lease
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
    *) RLASYNC_FLEX_KERNEL_OPTIONS="${best% *}" run tiles_best 110 $tp --out "$out/tiles_best.json" ;;
    esac
    ;;
learner_varlen)  # carry [".devicekit"]: the varlen tree attention (FlashAttention over root-path segments): its GPU
    # tests, then an A/B against the flex tree in one process at 8K rows (MFU, bf16 log-prob agreement), then its profile
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run varlen_tests 150 python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/gpu/test_model_gpu.py tests/gpu/test_learner_rows_gpu.py
    run varlen_ab_8k 260 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto --compile layers --modes tree,tree_varlen,padding_free --out "$out/varlen_ab_8k.json"
    run varlen_profile 150 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 4 --warmup 2 --grad-ckpt auto --compile layers --modes tree --attention varlen --profile "$out/profiles_varlen" --out "$out/varlen_profile.json"
    ;;
learner_final)  # carry [".devicekit", ".trlwheel"]: the learner against TRL 1.16's own tree packing in one call, both shapes
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run tree_trl 420 python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 200 --shapes 1088x256x8@4096,544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_packing_final.json"
    ;;
learner_parts)  # carry [".devicekit"]: bench/learner_parts.py's three probes, then the 8K tree row in the same lease
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run learner_parts 300 python3 bench/learner_parts.py --out "$out/learner_parts_h200.json"
    run tree_8k 200 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k.json"
    ;;
learner_knobs)  # carry [".devicekit"] (or [] when warm): FlexAttention's TMA / prescale / dQ options on a real row, then
    # the 8K tree row with inductor's coordinate-descent tuning and with TMA flex, same lease
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    python3 -m pip list 2>/dev/null | grep -i -E "cutlass|flash|triton" || true
    run flex_knobs 240 python3 bench/flex_tiles.py --configs default,tma,prescale,dq_in_dk_loop,tma_prescale --out "$out/flex_knobs_h200.json"
    run tree_8k_cdt 200 env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_cdt.json"
    run tree_8k_tma 150 env RLASYNC_FLEX_KERNEL_OPTIONS='{"USE_TMA": true}' python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-12} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_tma.json"
    ;;
learner_dq)  # carry [".devicekit"] (or [] when warm): the 8K tree row with FlexAttention's WRITE_DQ off and on, same lease
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    # ORDER=2 runs the default first, then WRITE_DQ off, then an option equal to the default (PRESCALE_QK false)
    if [ "${ORDER:-1}" = 2 ]; then
        run tree_8k_default 150 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_default.json"
    fi
    run tree_8k_nodq 150 env RLASYNC_FLEX_KERNEL_OPTIONS='{"WRITE_DQ": false}' python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_nodq.json"
    if [ "${ORDER:-1}" = 2 ]; then
        run tree_8k_noop 150 env RLASYNC_FLEX_KERNEL_OPTIONS='{"PRESCALE_QK": false}' python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_noop.json"
    else
        run tree_8k_default 150 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_8k_default.json"
    fi
    ;;
learner_head)  # carry [".devicekit"]: the LM head keeping probabilities (RLASYNC_HEAD_KEEP=probs: no dense backward pass
    # over the logits) against kept logits on the 8K tree row, same lease, alternating; the GPU head tests first; a
    # kernel profile of two probs rows
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run head_tests 120 python3 -m pytest -q tests/unit/model/test_head_devices.py tests/unit/model/test_head_probs.py
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --modes tree"
    run tree_8k_probs 150 env RLASYNC_HEAD_KEEP=probs $tp --out "$out/tree_8k_probs.json"
    run tree_8k_logits 150 env RLASYNC_HEAD_KEEP=logits $tp --out "$out/tree_8k_logits.json"
    run tree_8k_probs2 150 env RLASYNC_HEAD_KEEP=probs $tp --profile "$out/profiles" --profile-steps 2 --out "$out/tree_8k_probs2.json"
    ;;
flash_kit)  # carry [".fa4a"]: the first half of FlashAttention-4's CuTe DSL runtime (nvidia-cutlass-dsl-libs-cu13, xz),
    # left in /tmp/kit for learner_flash, which must follow within 30 s (warm). Kits: .fa4a holds cu13.tar.xz.part00,
    # .fa4b part01 and the wheels flash-attn-4 (+ old/ for an earlier one), nvidia-cutlass-dsl(-libs-base, -libs-core),
    # apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels, pydantic (+ its three)
    mkdir -p /tmp/kit && cp .fa4a/* /tmp/kit/ && ls -la /tmp/kit
    ;;
learner_flash)  # carry [".fa4b"] right after flash_kit: FlexAttention's FLASH backend (FlashAttention-4, CuTe DSL)
    # against its Triton kernels on a real 8K tree row, then the learner's 8K tree rows with each, same lease
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
    run tree_8k_flash 170 env RLASYNC_FLEX_KERNEL_OPTIONS='{"BACKEND": "FLASH"}' $tp --out "$out/tree_8k_flash.json"
    run tree_8k_triton 150 $tp --out "$out/tree_8k_triton.json"
    run tree_8k_flash_probs 150 env RLASYNC_HEAD_KEEP=probs RLASYNC_FLEX_KERNEL_OPTIONS='{"BACKEND": "FLASH"}' $tp --out "$out/tree_8k_flash_probs.json"
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)  # at most 8 files come back
    ;;
learner_rows)  # carry [".pydkit"] (pydantic and its three wheels): the 8K shape on full rows (40 groups: every row 7,875
    # tokens) and on the 8-group mix (7,875 + 4,725), each with the head keeping logits and probabilities in one
    # process (logits, probs, logits again); a kernel profile of the full rows; GPU clocks and power sampled throughout
    use_pydkit || exit 1
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active --format=csv -lms 1000 > "$out/smi.csv" 2>&1 &
    smi=$!
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --warmup 2 --compile layers --grad-ckpt auto --check-rows 0 --modes tree_logits,tree_probs,tree"
    run tree_8k_full 240 $tp --groups 40 --steps ${ROWS:-24} --profile "$out/profiles" --profile-steps 2 --out "$out/tree_8k_full.json"
    run tree_8k_mix 180 $tp --groups 8 --steps ${ROWS:-24} --out "$out/tree_8k_mix.json"
    kill $smi
    (cd "$out" && tar czf logs.tgz *.log profiles && rm -rf *.log profiles)  # at most 8 files come back
    ;;
learner_static)  # carry [".pydkit"] (or [] when warm): the 8-group mix (rows of 7,875 and 4,725 tokens) with the
    # compiled layers static per row length (--static-shapes) and dynamic (Dynamo's default after a second length),
    # alternating, same lease
    use_pydkit || exit 1
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps ${ROWS:-24} --warmup 2 --compile layers --grad-ckpt auto --check-rows 0 --modes tree"
    run mix_static 150 $tp --static-shapes --out "$out/mix_static.json"
    run mix_dynamic 150 $tp --out "$out/mix_dynamic.json"
    run mix_static2 150 $tp --static-shapes --out "$out/mix_static2.json"
    grep -h '"mfu"' "$out"/mix_*.log
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)
    ;;
learner_full)  # carry [".pydkit", ".trlwheel"]: the 8-group mix of the 8K shape (rows of 7,875 and 4,725 tokens, 96 rows
    # after 6 of warm-up), then ours and TRL 1.16's own tree packing in one call on full rows (40 groups: the 8K shape's
    # rows all 7,875 tokens, the 4K shape's 3,143), both shapes
    use_pydkit || exit 1
    run tree_8k_mix 130 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 96 --warmup 6 --compile layers --grad-ckpt auto --check-rows 0 --modes tree --out "$out/tree_8k_mix.json"
    run tree_trl_full 440 python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 240 --shapes 1088x256x8@4096,544x128x8@8192 --groups 40 --steps ${ROWS:-48} --warmup 4 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_packing_full.json"
    (cd "$out" && tar czf logs.tgz *.log && rm -f *.log)
    ;;
learner_headdyn)  # carry [".pydkit"]: the LM head's compiled passes with only the chunk length dynamic (the default now)
    # against every size dynamic (RLASYNC_HEAD_DYNAMIC=all, as before), full 8K rows, alternating; the GPU head tests;
    # a kernel profile of the default
    use_pydkit || exit 1
    tp="python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 40 --steps 96 --warmup 6 --compile layers --grad-ckpt auto --check-rows 0 --modes tree"
    run head_rows 130 env RLASYNC_HEAD_DYNAMIC=rows $tp --out "$out/head_rows.json"
    run head_all 130 env RLASYNC_HEAD_DYNAMIC=all $tp --out "$out/head_all.json"
    run head_rows2 150 env RLASYNC_HEAD_DYNAMIC=rows $tp --profile "$out/profiles" --profile-steps 2 --out "$out/head_rows2.json"
    grep -h '^tree {' "$out"/head_*.log
    run head_tests 90 python3 -m pytest -q -p no:cacheprovider tests/unit/model/test_head_devices.py tests/unit/model/test_head_dynamic.py
    (cd "$out" && tar czf logs.tgz *.log profiles && rm -rf *.log profiles)
    ;;
learner_trl8k)  # carry [".pydkit", ".trlwheel"]: ours and TRL 1.16 on full 8K rows only, one call (~3 min with the start)
    use_pydkit || exit 1
    python3 bench/tree_packing.py --trl-wheel .trlwheel/trl-1.16.0-py3-none-any.whl --trl-timeout-s 110 --shapes 544x128x8@8192 --groups 40 --steps 64 --warmup 6 --compile layers --grad-ckpt auto --modes tree --out "$out/tree_trl_8k_full.json" > "$out/tree_trl_8k_full.log" 2>&1
    grep -E "^tree|trl anchor|speedup" "$out/tree_trl_8k_full.log"
    ;;
learner_agree)  # carry [".pydkit"]: the bf16 log-prob gap of tree rows against padding-free rows of the same samples
    # (issue 12's bound: max |delta| <= 0.023), the 8K shape, 8 rows of each checked (~3 min with the start)
    use_pydkit || exit 1
    # --fp32-reference: each mode's error against an fp32 forward of each sample alone (padded: a third bf16 layout)
    run agree_8k 300 python3 bench/tree_packing.py --shapes 544x128x8@8192 --groups 8 --steps 12 --warmup 2 --compile layers --grad-ckpt auto --check-rows 8 --modes tree,padding_free,padded --fp32-reference --out "$out/agree_8k.json"
    grep -h -A16 '"logprob_max_abs_diff"' "$out/agree_8k.json"
    ;;
learner_host)  # carry [".devicekit", ".whl"]: where the learner's host time goes at 8K rows: py-spy on the tree bench's
    # timed loop (300 rows, flex, compiled layers), after its compile; then bench/pyspy_top.py over the samples
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
learner_varlen_e2e)  # carry [".devicekit"] (or [] when warm): GRPO on one shared H200 with the learner on the varlen tree attention
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run varlen_ab_4k 200 python3 bench/tree_packing.py --shapes 1088x256x8@4096 --groups 8 --steps 6 --warmup 2 --grad-ckpt auto --compile layers --modes tree,tree_varlen --out "$out/varlen_ab_4k.json"
    run e2e_varlen 170 env RLASYNC_TREE_ATTENTION=varlen python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --weight-sync-backend ipc --out "$out/e2e_ipc_varlen.json"
    ;;
sampler_system)  # carry [".devicekit"]: GRPO on one shared H200, the compiled sampler (default, after the one-graph fix) vs eager
    [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    for m in false true; do
        run e2e_sampler_$m 115 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --weight-sync-backend ipc --engine-kwargs "{\"compiled_sampler\": $m}" --out "$out/e2e_ipc_sampler_$m.json"
    done
    ;;
vllm_recheck)  # carry [".vllmkit", ".whl"] after a stage that installed .devicekit (warm): both engines 256x256 (warm-ups
    # fixed), vLLM's IPC sync in GRPO with py-spy on its GenerationActor (what holds the event loop the sync waits for)
    [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1
    [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1 PATH=/tmp/pyspy/bin:$PATH
    run vllm_speed 300 python3 bench/vllm_check.py --out "$out/vllm_speed" --budget-s 240 --skip-server --engine-mode default --skip-phases correctness,weight_sync
    # the actor's pid from Ray's log prefix (on 2026-12-02 no process matched `pgrep -f ray::GenerationActor`), once
    # the run has reached step 3 (vLLM started, syncs under way)
    (for _ in $(seq 150); do grep -q "^step 3/" "$out/e2e_vllm_ipc.log" 2>/dev/null && break; sleep 1; done
     p=$(grep -o "GenerationActor pid=[0-9]*" "$out/e2e_vllm_ipc.log" | head -1 | cut -d= -f2); [ -n "$p" ] && \
        py-spy record -d 15 -r 100 -f raw -p "$p" -o "$out/pyspy_vllm_GenerationActor.txt" > "$out/pyspy_vllm.log" 2>&1) &
    run e2e_vllm_ipc 200 python3 bench/e2e_grpo.py --steps 10 --runs async --engine vllm --share-gpu --vllm-gpu-memory-utilization 0.4 --weight-sync-backend ipc --out "$out/e2e_vllm_ipc_h200.json"
    wait
    python3 bench/pyspy_top.py "$out"/pyspy_vllm_*.txt > "$out/top_vllm.txt" 2>&1
    ;;
vllm_sync)  # carry [".vllmkit", ".whl"] after a stage that installed .devicekit (warm): vLLM's flat IPC sync alone
    # (the collective_rpc round trip against the worker's own copy time, idle and generating), then GRPO
    # (STEPS, default 10) with py-spy over the GenerationActor and its EngineCore child (--subprocesses);
    # GRPO_ONLY=1: the GRPO run alone
    [ -d /tmp/vsite/vllm ] || bash .vllmkit/unpack.sh || exit 1
    # its own folder: into /tmp/site (which has a bin/ from the kit) pip would leave the py-spy binary out
    [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1 PATH=/tmp/pyspy/bin:$PATH
    [ -n "${GRPO_ONLY:-}" ] || run vllm_unit 90 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/engine/test_vllm_engine.py tests/unit/engine/test_weight_plans.py
    [ -n "${GRPO_ONLY:-}" ] || run vllm_sync 270 python3 bench/vllm_check.py --out "$out/vllm_sync" --budget-s 240 --skip-server --engine-mode default --skip-phases correctness,throughput --skip-torch-engine
    (for _ in $(seq 150); do grep -q "^step 3/" "$out/e2e_vllm_ipc.log" 2>/dev/null && break; sleep 1; done
     p=$(grep -o "GenerationActor pid=[0-9]*" "$out/e2e_vllm_ipc.log" | head -1 | cut -d= -f2); [ -n "$p" ] && \
        py-spy record --subprocesses -d 12 -r 200 -f raw -p "$p" -o "$out/pyspy_vllm_GenerationActor.txt" > "$out/pyspy_vllm.log" 2>&1) &
    run e2e_vllm_ipc 240 python3 bench/e2e_grpo.py --steps ${STEPS:-10} --runs async --engine vllm --share-gpu --vllm-gpu-memory-utilization 0.4 --weight-sync-backend ipc --out "$out/e2e_vllm_ipc_h200.json"
    wait
    python3 bench/pyspy_top.py "$out"/pyspy_vllm_*.txt > "$out/top_vllm.txt" 2>&1
    ;;
engine_sampler)  # carry [] after a stage that installed the kit (warm: /tmp/site): the compiled sampler against the eager one, its CUDA tests
    export PYTHONPATH=$PWD:/tmp/site
    run sampler_tests 150 python3 -m pytest -q -p no:cacheprovider -rf -m "gpu or slow or not slow" tests/unit/engine/test_sampler_compiled.py tests/unit/engine/test_torch_engine_cuda.py
    run sampler_compare 240 python3 bench/engine_throughput.py --compiled-sampler compare --no-hf --concurrency 64,256 --out "$out/engine_compiled_sampler_h200.json"
    ;;
sync_baseline)  # carry [".devicekit"]: async (max_staleness 2 and 4) against the synchronous baseline (0), one shared H200
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicekit/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    run e2e_s4 170 python3 bench/e2e_grpo.py --steps 12 --runs async,sync --share-gpu --weight-sync-backend ipc --out "$out/e2e_sync_vs_s4_h200.json"
    run e2e_s2 120 python3 bench/e2e_grpo.py --steps 12 --runs async --max-staleness 2 --share-gpu --weight-sync-backend ipc --out "$out/e2e_s2_h200.json"
    ;;
vllm_sums)  # after system_torch's SmolLM2 calls and a call that ran `bash .vllmkit/unpack.sh`: vLLM in the system
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    st="python3 bench/system_throughput.py --out $out/system_throughput_h200.json"
    run system_vllm 330 $st system --engine vllm --steps 80 --run-dir /tmp/st_vllm
    ckpt=$(ls -d /tmp/st_vllm/checkpoint-* | sort -V | tail -1)
    run engine_vllm 150 $st engine --engine vllm --model "$ckpt" --seconds 20
    ;;
lora)  # LoRA on one H200 (vLLM kit unpacked in an earlier call): adapter sync times, LoRA GRPO with both engines
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run lora_sync 150 python3 bench/lora_sync.py --out "$out/lora_h200.json"
    run e2e_lora_torch 170 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --lora-rank 32 --out "$out/e2e_lora_torch.json"
    run e2e_lora_vllm 220 python3 bench/e2e_grpo.py --steps 8 --runs async --share-gpu --lora-rank 32 --engine vllm --out "$out/e2e_lora_vllm.json"
    ;;
vllm)
    bash .vllmkit/unpack.sh || exit 1
    export PYTHONPATH=/tmp/vsite:$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    run e2e_vllm 300 python3 bench/e2e_grpo.py --steps 10 --runs async --engine vllm --out "$out/e2e_vllm.json"
    run vllm_check 240 python3 bench/vllm_check.py --out "$out" --budget-s 200 --skip-server
    ;;
*)
    echo "unknown stage $stage: use torch, vllm or distill" >&2
    exit 2
    ;;
esac
