#!/bin/bash
# The GPU measurements of training throughput and parity, for docs/results/README.md. Each part stays under 10 minutes on H200s.
#   slurm/gpu_checks.sh 100m        # one GPU: ~100M KDN, 500 steps, falling loss
#   slurm/gpu_checks.sh throughput [MIXERS]  # one GPU: 750M kdn_diag,kdn_iso,kda (or MIXERS) side by side
#   slurm/gpu_checks.sh throughput_paper [MIXERS]  # the same at the paper's 0.5M-token batch (default kdn_diag,kda)
#   slurm/gpu_checks.sh parity      # two GPUs: 1-GPU vs 2-GPU (DDP and FSDP) loss curves (= parity1, parity2)
#   slurm/gpu_checks.sh parity1     # its one-GPU reference run alone (it may run beside other work)
#   slurm/gpu_checks.sh parity2 ["ddp fsdp"]  # its two-GPU runs (default both), each compared with the reference
#   slurm/gpu_checks.sh resume2 [fsdp|ddp]    # two GPUs: exact resume (40 steps against 20 + resume + 20) and the
#                                             # HF export of a sharded run, loaded back
# Results: the summary tables printed at the end, and runs/<name>/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# Shards prepared elsewhere (a machine without the corpus package can carry data/cache/) are used as they are.
DATA=()
if [ -f data/cache/embedded-kjv-val10-mistral-v1/meta.json ]; then DATA=(data.auto_prepare=false); fi
# Without wandb installed (a bare GPU image), log JSONL only.
if ! python -c "import wandb" 2>/dev/null; then DATA+=(logging.wandb.mode=disabled); fi
case "${1:-}" in
  100m)
    rm -rf runs/gpu_100m_kdn_diag
    python train.py experiment=gpu_100m_kdn_diag "${DATA[@]}"
    python -m trainer.summarize runs/gpu_100m_kdn_diag --json runs/gpu_100m_kdn_diag/summary.json
    ;;
  throughput|throughput_paper)
    if [ "$1" = throughput ]; then exp=gpu_throughput_750m mixers=kdn_diag,kdn_iso,kda
    else exp=gpu_throughput_750m_paper_batch mixers=kdn_diag,kda; fi
    rm -rf "runs/$exp"
    python train.py -m experiment=$exp mixer="${2:-$mixers}" "${DATA[@]}"
    python -m trainer.summarize "runs/$exp"/[0-9]* --json "runs/$exp/summary.json"
    ;;
  parity)
    "$0" parity1
    "$0" parity2
    ;;
  parity1)
    rm -rf runs/gpu_parity_1gpu
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python train.py experiment=gpu_parity_100m name=gpu_parity_1gpu \
      "${DATA[@]}"
    python -m trainer.summarize runs/gpu_parity_1gpu --json runs/gpu_parity_1gpu/summary.json
    ;;
  parity2)
    if [ ! -f runs/gpu_parity_1gpu/metrics.jsonl ]; then
      echo "parity2 compares with runs/gpu_parity_1gpu: run parity1 first" >&2
      exit 2
    fi
    runs=(runs/gpu_parity_1gpu) rc=0
    for mode in ${2:-ddp fsdp}; do
      case "$mode" in
        ddp) name=gpu_parity_2gpu ;;
        fsdp) name=gpu_parity_2gpu_fsdp ;;
        *) echo "parity2 modes: ddp fsdp (got $mode)" >&2; exit 2 ;;
      esac
      rm -rf "runs/$name"
      accelerate launch --multi_gpu --num_processes 2 train.py \
        experiment=gpu_parity_100m name="$name" trainer.distributed="$mode" "${DATA[@]}"
      python -m trainer.summarize runs/gpu_parity_1gpu "runs/$name" --compare --json "runs/$name/compare.json" \
        || rc=1
      runs+=("runs/$name")
    done
    python -m trainer.summarize "${runs[@]}"
    exit $rc
    ;;
  resume2)
    # two GPUs: 40 steps straight against 20 + resume + 20 (checkpoint at 20), then the HF export loaded back
    mode=${2:-fsdp}
    case "$mode" in ddp|fsdp) ;; *) echo "resume2 modes: ddp fsdp (got $mode)" >&2; exit 2 ;; esac
    args=(experiment=gpu_parity_100m trainer.distributed="$mode" trainer.max_steps=40 trainer.ckpt_every=20
          trainer.eval_every=20 trainer.export=true "${DATA[@]}")
    straight=gpu_resume_${mode}_straight split=gpu_resume_${mode}_split
    rm -rf "runs/$straight" "runs/$split"
    launch=(accelerate launch --multi_gpu --num_processes 2 train.py "${args[@]}")
    "${launch[@]}" name="$straight"
    "${launch[@]}" name="$split" trainer.stop_after=20
    "${launch[@]}" name="$split"  # resumes from its step-20 checkpoint
    rc=0
    python -m trainer.summarize "runs/$straight" "runs/$split" --compare --tol 0 --json "runs/$split/compare.json" \
      || rc=1
    python -c "import sys, models, torch; from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); x = torch.randint(3, 1000, (1, 64))
print(sys.argv[1], f'{sum(p.numel() for p in m.parameters()):,} parameters; loss', m(x, labels=x).loss.item())" \
      "runs/$split/hf"
    exit $rc
    ;;
  *)
    echo "usage: $0 100m|throughput|throughput_paper|parity|parity1|parity2|resume2" >&2
    exit 2
    ;;
esac
