"""Where one step of the mini team's learning loop spends its time, set against the FLOPs it does and this machine's
measured single-core matmul rate (the table in benchmarks/README.md, "Where a step's time goes").

Run in a folder laid out as benchmarks/bench_mini_loop.py makes one (runs/mini/train, runs/mini/sft/final/<agent>):

    OMP_NUM_THREADS=1 python scripts/profile_loop.py marl --steps 3 [--skip 1] [--set key=value ...]
    OMP_NUM_THREADS=1 python scripts/profile_loop.py sft --steps 20

It wraps a few functions with timers (the sampler's prefill and decode forwards, the tools, the learner's forward,
backward and optimizer step) and counts tokens; it changes no result. FLOPs per token are 2 x the weights a token
multiplies (embedding lookups excluded, the tied output layer included) plus the attention over the real tokens
before it (4 x layers x heads x head_dim x those tokens); the update's backward counts twice its forward. The
limit of a part is its FLOPs at the best measured rate.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

T = defaultdict(float)   # seconds by part
N = defaultdict(float)   # counts (tokens, calls) by part
STATE = {"phase": "other", "in": None}


def timed(owner, name: str, part, inner: str | None = None):
    """Wrap owner.name so its seconds add to T[part] (part: a key, or a function of the call's self/args)."""
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def wrapper(*a, **kw):
        key = part(*a, **kw) if callable(part) else part
        prev = STATE["in"]
        if inner:
            STATE["in"] = inner
        t0 = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            T[key] += time.perf_counter() - t0
            N[key + "#calls"] += 1
            STATE["in"] = prev
    setattr(owner, name, wrapper)


def install() -> None:
    import torch
    from transformers.models.qwen2 import modeling_qwen2 as q2
    from transformers.models.qwen3 import modeling_qwen3 as q3

    import m1.marl.actor.learner as L
    import m1.marl.actor.optimizer as O
    import m1.synth.vision as sv
    import m1.team.cpp as cpp
    import m1.tools.clip_index as ci
    import m1.video.reader as vr

    orig_gen = cpp.Team._generate

    def _generate(self, calls):
        STATE["phase"] = calls[0].phase if calls else "other"
        try:
            return orig_gen(self, calls)
        finally:
            STATE["phase"] = "other"
    cpp.Team._generate = _generate

    for cls in (q2.Qwen2ForCausalLM, q3.Qwen3ForCausalLM):
        orig_f = cls.forward

        def make(orig_f):
            @functools.wraps(orig_f)  # keeps logits_to_keep visible to generate (else logits at every position)
            def fwd(self, input_ids=None, *a, **kw):
                t0 = time.perf_counter()
                out = orig_f(self, input_ids, *a, **kw)
                dt = time.perf_counter() - t0
                b, t = tuple(input_ids.shape) if input_ids is not None else (0, 0)
                pkv = kw.get("past_key_values")
                past = pkv.get_seq_length() if pkv is not None and hasattr(pkv, "get_seq_length") else 0
                mask = kw.get("attention_mask")
                if STATE["in"] == "sample":
                    kind = "decode" if past and t == 1 else "prefill"
                    key = f"sample/{STATE['phase']}/{kind}"
                else:
                    key = "update/forward" if torch.is_grad_enabled() else "update/forward_nograd"
                    kind = "learn"
                T[key] += dt
                N[key + "#rows_x_tokens"] += b * t
                if mask is not None:  # each real query token attends to the real tokens up to itself
                    real = int(mask[:, -t:].sum())
                    pairs = int((mask.cumsum(-1)[:, -t:] * mask[:, -t:]).sum())
                else:
                    real, pairs = b * t, b * t * (past + (t + 1) / 2)
                N[key + "#real_tokens"] += real
                N[key + "#ctx_token_pairs"] += pairs
                N["params#" + key] = _flop_params(self)
                N["attn#" + key] = self.config.num_hidden_layers * self.config.num_attention_heads * _head_dim(self)
                return out
            return fwd
        cls.forward = make(orig_f)

    import m1.models.hf as hf
    timed(hf.HFChatModel, "_generate_batch", lambda self, *a, **k: f"sample/{STATE['phase']}/total", inner="sample")
    timed(cpp.Team, "_execute_phase", "tools/execute phase")
    timed(sv.SynthVisionModel, "describe", "tools/synth vision")
    timed(ci.ClipIndex, "frame_embeddings", "tools/clip frames")
    timed(ci.ClipIndex, "text_embedding", "tools/clip text")
    timed(vr.VideoReader, "_decode", "tools/frame decode")
    timed(L.Actor, "update", "update/total", inner="learn")
    timed(O.PolicyOptimizer, "backward", "update/backward", inner="learn")
    timed(O.PolicyOptimizer, "step", "update/optimizer", inner="learn")


def _head_dim(model) -> int:
    c = model.config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _flop_params(model) -> int:
    """Weights a token multiplies: every matrix but the input embedding (tied: the output layer counts once)."""
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    tied = model.get_output_embeddings().weight is emb
    return total if tied else total - emb.numel()


def matmul_rate(shapes=((32, 128, 384), (512, 128, 256), (2048, 128, 3148), (1, 128, 3148))) -> dict:
    """GFLOP/s of one thread for [m, k] @ [k, n] at the model's shapes (best of 5 timings)."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = max(3, int(2e8 / (2 * m * k * n)))
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            best = min(best, (time.perf_counter() - t0) / reps)
        out[(m, k, n)] = 2 * m * k * n / best / 1e9
    return out


def report(rows: list[dict], steps: int, rate: float) -> None:
    wall = sum(r.get("time/step", 0.0) for r in rows) / steps
    print(f"\nstep wall {wall:.2f} s (mean of {steps} steps); matmul limit {rate:.1f} GFLOP/s (1 thread)")
    print(f"{'part':34s} {'s/step':>8s} {'share':>6s} {'GFLOP':>8s} {'limit s':>8s} {'x limit':>8s}  tokens")
    done = 0.0
    for key in sorted(k for k in T if "#" not in k):
        s = T[key] / steps
        fl = 0.0
        if f"{key}#real_tokens" in N:
            fl = (2 * N["params#" + key] * N[f"{key}#real_tokens"]
                  + 4 * N["attn#" + key] * N[f"{key}#ctx_token_pairs"]) / steps / 1e9
        if key == "update/backward":  # twice its forward's FLOPs
            fl = 2 * (2 * N["params#update/forward"] * N["update/forward#real_tokens"]
                      + 4 * N["attn#update/forward"] * N["update/forward#ctx_token_pairs"]) / steps / 1e9
        limit = fl / rate if fl else 0.0
        tok = N.get(f"{key}#real_tokens", 0) / steps
        calls = N.get(f"{key}#calls", 0) / steps
        print(f"{key:34s} {s:8.3f} {100 * s / wall:5.1f}% {fl:8.3f} {limit:8.3f} "
              f"{(s / limit) if limit else float('nan'):8.1f}  {tok:.0f} tok, {calls:.0f} calls")
    leaf = [k for k in T if "#" not in k and not k.endswith("/total") and k != "tools/execute phase"]
    done = sum(T[k] for k in leaf) / steps
    print(f"{'(rest: python, dispatch, prompts)':34s} {wall - done:8.3f} {100 * (wall - done) / wall:5.1f}%")
    for k in ("time/rollout", "time/reward", "time/update"):
        if any(k in r for r in rows):
            print(f"  row {k}: {sum(r.get(k, 0.0) for r in rows) / steps:.3f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["marl", "sft"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=1, help="steps run first and left out (warm-up)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", default="runs/profile_loop")
    p.add_argument("--generate", action="store_true",
                   help="sample through transformers' generate (every chat model's prefix_cache_mb 0), as before")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    install()
    if args.generate:
        import m1.models.hf as hf

        init = hf.HFChatModel.__init__

        def without_sampler(self, *a, **kw):
            init(self, *a, **kw)
            self.sampler = None
        hf.HFChatModel.__init__ = without_sampler
    if os.path.exists(args.out):  # a finished run there would resume, run no step, and time nothing
        raise SystemExit(f"profile_loop: {args.out} exists (an earlier profile's run): remove it or pass --out")
    common = [f"out_dir={args.out}", "log.progress=false", "checkpoint.every=100000"]
    if args.kind == "marl":
        from m1.marl.config import load_train_config
        from m1.marl.parts import make_trainer

        steps = [f"steps={args.steps + args.skip}", "rollout.topology=complete"]
        trainer = make_trainer(load_train_config("mini_recipe", common + steps + args.set))
    else:
        from m1.marl.config import load_sft_config
        from m1.marl.sft import SFTTrainer

        trainer = SFTTrainer(load_sft_config("mini", common + [f"max_steps={args.steps + args.skip}"] + args.set))
    try:
        rows = trainer.train(stop_after=args.skip) if args.skip else []
        T.clear()
        N.clear()
        rows = trainer.train()
    finally:
        trainer.close()
    rates = matmul_rate()
    for shape, r in rates.items():
        print(f"matmul {shape}: {r:.1f} GFLOP/s")
    report(rows[-args.steps:], args.steps, max(rates.values()))


if __name__ == "__main__":
    sys.exit(main())
