#!/usr/bin/env bash
# The mini learning loop on a lent GPU machine: how long an SFT step and a MARL step take with the agents' models on
# CUDA, then on that machine's CPU (one torch thread, as on the 2-core machines), to size the whole experiment there.
# Run from the repository root on the device; the packages its image lacks travel as wheels in .whl/ (pydantic, av,
# open_clip and their needs: see the device README). Writes $OUT/gpu_loop.json and $OUT/cpu_loop.json.
set -euo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 M1_CACHE=${M1_CACHE:-/tmp/m1cache} PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
python3 -c "import m1.marl.trainer, m1.marl.sft; print('m1 imports')"
python3 benchmarks/bench_mini_loop.py --no-baseline --device cuda --reps 1 --sft-steps 20 --marl-steps 3 \
    --variant cheap=grpo.baseline=group,learner.prompt_grad=false --json "${OUT:-/tmp}/gpu_loop.json"
python3 benchmarks/bench_mini_loop.py --no-baseline --device cpu --reps 1 --sft-steps 20 --marl-steps 3 \
    --variant cheap=grpo.baseline=group,learner.prompt_grad=false --json "${OUT:-/tmp}/cpu_loop.json"
