"""Our GRPO step (AgentLearner: generate + update) vs TRL 1.16.0's GRPOTrainer step, one agent, same tiny model.

Both sides load the same tiny random Qwen2 folder (H=256, L=4 by default; TRL needs a folder rather than a model
object when beta > 0, because it rebuilds the reference model from the path) and train it in full fp32 on CPU, in
one process with the same torch thread count. Same prompts, batch (8 prompts x 4 generations), completion length
(min_new_tokens = max_new_tokens on both sides, so every completion has exactly that many tokens), temperature 1,
beta, learning rate (constant), clip epsilon, max grad norm, loss type `grpo`, and the same two Python reward
functions.

One step, on both sides: sample K completions per prompt, score them, group advantages, reference log-probs
(beta > 0), policy log-probs with gradient, loss, backward, clip, AdamW step. TRL's step is timed from its
`on_step_begin` to its `on_step_end` callback (inside `Trainer.train()`); ours runs right after each TRL step, inside
that `on_step_end` callback, on the prompts TRL just used, so the two alternate and share machine noise. The
first `--warmup` pairs are not counted; the figure is the median per-step time over the rest.

Where the time goes is measured on both sides by timing wrappers around the pieces (generation, log-prob forwards
with and without gradient, rewards, backward, clip + optimizer step); "other" is the step time not covered.

    python benchmarks/bench_grpo_vs_trl.py [--steps 10] [--warmup 2] [--prompts 8] [--generations 4]
                                           [--tokens 64] [--hidden 256] [--layers 4] [--beta 0.04] [--json out.json]
                                           [--no-prompt-sharing]
"""
from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict

from _common import Figure, Result, cli, finish

TARGET = 0.8  # ours / TRL
TOPICS = ["the red square", "the blue circle", "the green triangle", "the yellow star", "the purple ring",
          "the white disc", "the grey cross", "the orange rectangle"]


def prompt_rows(n: int) -> tuple[list[list[dict]], list[str]]:
    """n distinct one-turn chats and their reference answers (the answer reward looks for it)."""
    chats, answers = [], []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        chats.append([{"role": "user", "content": f"Question {i}: How many times does {topic} cross the screen? "
                                                  "Options: A. 1 B. 2 C. 3 D. 4"}])
        answers.append("ABCD"[i % 4])
    return chats, answers


def length_reward(text: str) -> float:
    return -abs(len(text) - 40) / 40


def answer_reward(text: str, answer: str) -> float:
    return 1.0 if f"##Answer: {answer}" in text else (0.2 if answer in text else 0.0)


# TRL reward functions: conversational completions [[{"role": "assistant", "content": str}], ...]
def trl_length(completions, **kw):
    return [length_reward(c[0]["content"]) for c in completions]


def trl_answer(completions, answer, **kw):
    return [answer_reward(c[0]["content"], a) for c, a in zip(completions, answer)]


class Clock:
    """Seconds per named piece of the current step; `wrap` times a bound method through an instance attribute."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, label) -> None:
        orig = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.now[label() if callable(label) else label] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def close_step(self, total: float) -> None:
        row = dict(self.now)
        row["other"] = total - sum(row.values())
        row["step"] = total
        self.steps.append(row)
        self.now = defaultdict(float)

    def medians(self, skip: int) -> dict[str, float]:
        rows = self.steps[skip:]
        keys = sorted({k for r in rows for k in r})
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def _grad_label(with_grad: str, without: str):
    import torch

    return lambda: with_grad if torch.is_grad_enabled() else without


class OurSide:
    """One AgentLearner (sampler and actor) and the step the MARL trainer performs for one agent, minus the
    multi-agent team."""

    def __init__(self, folder: str, args, answers_of: dict[str, str]):
        from m1.config import ModelSpec
        from m1.marl.config import GRPOSettings, LearnerConfig
        from m1.marl.actor.learner import AgentLearner

        spec = ModelSpec(interface="chat", path=folder, dtype="float32", device="cpu")
        cfg = LearnerConfig(finetune="full", lr=args.lr, weight_decay=0.0, max_grad_norm=1.0,
                            micro_batch_size=args.prompts * args.generations, max_prompt_tokens=1024,
                            max_completion_tokens=args.tokens, precision="fp32",
                            share_prompt_forward=not args.no_prompt_sharing)
        grpo = GRPOSettings(beta=args.beta, clip_eps_low=0.2, loss_type="grpo", scale_rewards=True,
                            old_logprobs="policy")
        self.learner = AgentLearner.build("solo", "solo", spec, cfg, grpo, seed=args.seed)
        # Forced length, as TRL's generation_kwargs below: `generate` merges this default into its call.
        self.learner.actor.policy.generation_config.min_new_tokens = args.tokens
        self.args, self.answers_of = args, answers_of
        self.clock = Clock()
        self.clock.wrap(self.learner.actor, "compute_logprobs", _grad_label("logprobs (policy, grad)",
                                                                            "logprobs (reference)"))
        self.clock.wrap(self.learner.actor.optim, "backward", "backward")
        self.clock.wrap(self.learner.actor.optim, "step", "clip + optimizer")
        self.lengths: list[int] = []

    def step(self, chats: list[list[dict]], index: int) -> float:
        from m1.marl.algo.advantages import group_advantages
        from m1.marl.rollout.episodes import Sample
        from m1.models.base import ChatRequest, SamplingParams

        a, k = self.args, self.args.generations
        t0 = time.perf_counter()
        requests = [ChatRequest(messages=c) for c in chats for _ in range(k)]
        params = SamplingParams(max_new_tokens=a.tokens, temperature=1.0, top_p=1.0, seed=a.seed * 1000 + index)
        t = time.perf_counter()
        comps = self.learner.sampler.generate(requests, params)
        self.clock.now["generation"] += time.perf_counter() - t
        t = time.perf_counter()
        answers = [self.answers_of[c[0]["content"]] for c in chats for _ in range(k)]
        rewards = [length_reward(c.text) + answer_reward(c.text, ans) for c, ans in zip(comps, answers)]
        adv = group_advantages([rewards[g * k:(g + 1) * k] for g in range(len(chats))])
        samples = [Sample(agent="solo", question_id=str(g), group=g, rollout=r, phase="plan",
                          prompt_ids=comps[g * k + r].prompt_ids, completion_ids=comps[g * k + r].completion_ids,
                          logprobs=comps[g * k + r].logprobs, reward=rewards[g * k + r],
                          advantage=float(adv[g, r]), temperature=1.0)
                   for g in range(len(chats)) for r in range(k)]
        self.clock.now["rewards + advantages"] += time.perf_counter() - t
        self.stats = self.learner.actor.update(samples, a.lr, "grpo")
        total = time.perf_counter() - t0
        self.clock.close_step(total)
        self.lengths += [len(c.completion_ids) for c in comps]
        return total


def build_trl(folder: str, args, chats, answers, callbacks):
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok.padding_side = "left"
    ds = Dataset.from_dict({"prompt": chats, "answer": answers})
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="m1-bench-trl-"), max_steps=args.warmup + args.steps,
                     per_device_train_batch_size=args.prompts * args.generations,
                     num_generations=args.generations, max_completion_length=args.tokens,
                     generation_kwargs={"min_new_tokens": args.tokens}, temperature=1.0, top_p=1.0, top_k=0,
                     learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                     beta=args.beta, epsilon=0.2, loss_type="grpo", scale_rewards="group",
                     shuffle_dataset=False, logging_steps=args.warmup + args.steps, save_strategy="no",
                     report_to="none", use_cpu=True, bf16=False, dataloader_num_workers=0, seed=args.seed,
                     disable_tqdm=True)
    trainer = GRPOTrainer(model=folder, processing_class=tok, reward_funcs=[trl_length, trl_answer], args=cfg,
                          train_dataset=ds, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its metric dicts would bury the table
    return trainer


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="completion length, forced on both sides")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, both sides (1: on a shared 2-core machine two threads stall each other)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prompt-sharing", action="store_true",
                   help="ours: one joint prompt+completion forward per row (learner.share_prompt_forward: false)")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit(f"--steps and --threads must be >= 1 and --warmup >= 0, got {args.steps}, "
                         f"{args.threads} and {args.warmup}")

    import os
    import warnings

    import torch
    from transformers import TrainerCallback

    from m1.config import TinySpec
    from m1.models.tiny import ensure_tiny

    # TRL's config and the Trainer emit deprecation notices about their own internals on every run
    warnings.filterwarnings("ignore", category=FutureWarning)
    threads = args.threads
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    folder = str(ensure_tiny(TinySpec(arch="qwen2", hidden_size=args.hidden, layers=args.layers, heads=4,
                                      kv_heads=2, seed=args.seed)))
    n_steps = args.warmup + args.steps
    chats, answers = prompt_rows(n_steps * args.prompts)
    answers_of = {c[0]["content"]: a for c, a in zip(chats, answers)}
    ours = OurSide(folder, args, answers_of)

    trl_clock = Clock()
    seen: dict[str, list] = {"prompts": []}
    trl_lengths: list[int] = []

    class Alternate(TrainerCallback):
        """Times each TRL step, then runs one of ours on the same prompts before TRL's next step."""

        def on_pre_optimizer_step(self, targs, state, control, **kw):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, targs, state, control, **kw):
            trl_clock.now["clip + optimizer"] += time.perf_counter() - self.t_opt

        def on_step_begin(self, targs, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            trl_clock.close_step(time.perf_counter() - self.t0)
            unique = list(dict.fromkeys(c[0]["content"] for c in seen["prompts"]))
            if len(unique) != args.prompts:
                raise RuntimeError(f"TRL step {state.global_step} used {len(unique)} distinct prompts, "
                                   f"expected {args.prompts}")
            ours.step([[{"role": "user", "content": u}] for u in unique], state.global_step)

    trainer = build_trl(folder, args, chats, answers, [Alternate()])
    trl_clock.wrap(trainer, "_generate_single_turn", "generation")
    trl_clock.wrap(trainer, "_get_per_token_logps_and_entropies",
                   _grad_label("logprobs (policy, grad)", "logprobs (reference)"))
    trl_clock.wrap(trainer, "_clip_grad_norm", "clip + optimizer")
    trl_clock.wrap(trainer.accelerator, "backward", "backward")
    orig_rewards = trainer._calculate_rewards

    def rewards(inputs, prompts, completions, completion_ids_list):
        seen["prompts"] = prompts
        trl_lengths.extend(len(c) for c in completion_ids_list)
        t = time.perf_counter()
        out = orig_rewards(inputs, prompts, completions, completion_ids_list)
        trl_clock.now["rewards + advantages"] += time.perf_counter() - t
        return out

    trainer._calculate_rewards = rewards
    setup_s = time.perf_counter() - t0
    trainer.train()

    if len(trl_clock.steps) != n_steps or len(ours.clock.steps) != n_steps:
        raise RuntimeError(f"expected {n_steps} steps per side, got TRL {len(trl_clock.steps)}, "
                           f"ours {len(ours.clock.steps)}")
    bad = sorted({n for n in trl_lengths + ours.lengths if n != args.tokens})
    if bad:
        raise RuntimeError(f"completion lengths {bad} differ from the forced {args.tokens} tokens")
    tm, om = trl_clock.medians(args.warmup), ours.clock.medians(args.warmup)
    ratio = om["step"] / tm["step"]
    params = sum(p.numel() for p in ours.learner.actor.optim.params)

    res = Result("bench_grpo_vs_trl.py")
    res.add("model", f"tiny random Qwen2 H={args.hidden} L={args.layers} ({params / 1e6:.2f} M params, "
                     f"vocab {ours.learner.actor.tokenizer.vocab_size}), full fine-tune, fp32, CPU, "
                     f"{torch.get_num_threads()} torch threads")
    res.add("batch", f"{args.prompts} prompts x {args.generations} generations x {args.tokens} tokens (forced), "
                     f"beta {args.beta}, lr {args.lr}, loss grpo")
    res.add("setup (load both, not timed)", f"{setup_s:.2f} s")
    trl_opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    res.add("optimizers", f"ours {type(ours.learner.actor.optim.optimizer).__name__}, TRL {type(trl_opt).__name__} "
                          f"(optim={trainer.args.optim})")
    res.add("steps", f"{args.warmup} warm-up + {args.steps} timed per side, alternating")
    st = ours.stats
    res.add("ours, last update", f"loss {st['loss']:.3g}, kl {st.get('kl', float('nan')):.3g}, grad norm "
                                 f"{st['grad_norm']:.3g}, mean |recomputed - sampled log-prob| "
                                 f"{st.get('logp_gap', float('nan')):.2g}")
    res.add("TRL per-step times (s)", ", ".join(f"{r['step']:.3f}" for r in trl_clock.steps[args.warmup:]))
    res.add("ours per-step times (s)", ", ".join(f"{r['step']:.3f}" for r in ours.clock.steps[args.warmup:]))
    pieces = ["generation", "rewards + advantages", "logprobs (reference)", "logprobs (policy, grad)", "backward",
              "clip + optimizer", "other"]
    for piece in pieces:
        res.add(f"median {piece}: ours / TRL",
                f"{om.get(piece, 0.0) * 1e3:.1f} ms / {tm.get(piece, 0.0) * 1e3:.1f} ms")
    note = ""
    if ratio > TARGET:
        share = ", ".join(f"{k} {om.get(k, 0.0) / om['step']:.0%}" for k in pieces
                          if om.get(k, 0.0) >= 0.05 * om["step"])
        gaps = sorted(((om.get(k, 0.0) - tm.get(k, 0.0), k) for k in pieces), reverse=True)
        note = (f"our step: {share}; slower than TRL in: "
                + (", ".join(f"{k} +{d * 1e3:.0f} ms" for d, k in gaps[:3] if d > 0) or "nothing")
                + "; see README")
    res.figures.append(Figure(
        figure=f"GRPO step, one agent, Qwen2 H={args.hidden} L={args.layers}, "
               f"{args.prompts}x{args.generations}x{args.tokens} tokens, beta {args.beta} (median of {args.steps})",
        baseline=f"TRL {tm['step']:.3f} s", measured=f"ours {om['step']:.3f} s", ratio=ratio,
        ratio_def="ours / TRL", target=f"<= {TARGET}", met=ratio <= TARGET, note=note))
    finish(res, args.json)


if __name__ == "__main__":
    main()
