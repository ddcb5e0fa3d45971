#!/usr/bin/env bash
# Multi-agent GRPO on a Ray cluster: one learner actor per trained agent (num_gpus_per_learner GPUs each, e.g. one
# A100), while the driver on the head node runs the team's rollouts, the tools and their vision/CLIP models, and
# the reward judge. Generation of each agent runs inside its actor, on the weights being trained.
#
#   head node:    scripts/train_ray.sh configs/marl/videochat_m1_lora.yaml [key.path=value ...]
#   other nodes:  ray start --address=<head-ip>:6379 --num-gpus=<gpus on that node>
#
# The script starts a Ray head here when none is running (NUM_GPUS defaults to the GPUs nvidia-smi lists), then
# runs the trainer with placement=ray against it. Rerunning the same command resumes from the newest checkpoint
# in the config's out_dir. Set PYTHON to choose the interpreter (default: python).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [key.path=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
PY=${PYTHON:-python}

if ! ray status >/dev/null 2>&1; then
  if [[ -z "${NUM_GPUS:-}" ]]; then
    NUM_GPUS=$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L | wc -l || echo 0)
  fi
  echo "starting a Ray head with ${NUM_GPUS} GPUs" >&2
  ray start --head --num-gpus="${NUM_GPUS}" --include-dashboard=false
fi

exec "$PY" -c 'import sys; from m1.marl.launch import train_main; train_main(sys.argv[1], sys.argv[2:])' \
  "$CONFIG" placement=ray ray.address=auto "$@"
