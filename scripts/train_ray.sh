#!/usr/bin/env bash
# Multi-agent GRPO (or, with M1_CMD=sft, SFT) on a Ray cluster. Before anything loads, the run plans its GPUs
# (print it with `m1 train --config CONFIG --plan`): each trained agent's learner is a ZeRO-2 group of
# `learner.gpus` Ray actors, one per GPU; the driver's models (browser, space and grounding tools, CLIP, a local
# judge) each get a GPU of their own; the plan's GPUs are reserved as one Ray placement group, and a plan that does
# not fit the cluster is refused naming the agent and the shortfall. out_dir must be on storage every node mounts
# at the same path (checked at start).
#
#   head node:    scripts/train_ray.sh configs/marl/videochat_m1_lora.yaml [key.path=value ...]
#   other nodes:  ray start --address=<head-ip>:6379 --num-gpus=<gpus on that node>
#
# The paper's recipe is SFT, then MARL, in this order (the MARL config's `init_from` names the SFT run's out_dir and
# starts from its weights; a missing or unfinished SFT run is refused before anything loads):
#   M1_CMD=sft scripts/train_ray.sh configs/sft/videochat_m1_lora.yaml     # -> runs/sft/videochat_m1_lora
#   scripts/train_ray.sh configs/marl/videochat_m1_lora.yaml               # init_from: runs/sft/videochat_m1_lora
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

if [[ "${M1_CMD:-train}" == "sft" ]]; then
  exec "$PY" -c 'import sys; from m1.marl.sft import sft_main; sft_main(sys.argv[1], sys.argv[2:])' \
    "$CONFIG" placement=ray ray.address=auto "$@"
fi
exec "$PY" -c 'import sys; from m1.marl.launch import train_main; train_main(sys.argv[1], sys.argv[2:])' \
  "$CONFIG" placement=ray ray.address=auto "$@"
