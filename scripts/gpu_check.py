#!/usr/bin/env python
"""One-GPU check of the training path at the paper's sizes, with nothing downloaded. Prints one JSON.

Steps (each timed; a failing step is recorded and the others still run; the exit status is 1 if any failed):
  1. lora_learner: a random Qwen3-8B (hidden 4096, 36 layers, 32 query / 8 KV heads, head_dim 128, vocab 151,936)
     written to a local folder and loaded by `AgentLearner` exactly as configs/marl/videochat_m1_lora.yaml builds it
     (LoRA r=8, DeepSpeed ZeRO-2, bf16, gradient checkpointing, 1,024 + 1,024 tokens);
  2. generate_8 / generate_32: Hugging Face generation on the learner's policy (the `hf` rollout engine) for 8 and 32
     prompts of 1,000 tokens -> 1,024 new tokens: tokens/s and peak memory;
  3. grpo_update: one GRPO step at the paper's batch (8 questions x K=4, 1,024 + 1,024 tokens): bf16 weights, fp32
     masters of the LoRA parameters, only LoRA parameters change, a finite loss;
  4. resume: save, update, reload the saved state, update again: the same loss;
  5. full_3b: full fine-tuning of a Qwen2.5-3B shape under ZeRO-2 on this one GPU (bf16 reference): fits or not.
On a card larger than an A100 the process is capped at 80 GiB, so the numbers say what an A100-80GB would hold.

`--tiny` runs the same steps on CPU with tiny models and lengths (the test suite runs it).

Needs torch, transformers, peft, pydantic, pyyaml and DeepSpeed (`pip install deepspeed==0.19.8`; without it the
learner runs in plain torch and the JSON says so). It does not need open_clip, decord, PyAV, Ray or TRL.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

A100_BYTES = 80 * 2**30


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "deepspeed", "pydantic"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _device_info(tiny: bool) -> dict:
    import torch

    if tiny or not torch.cuda.is_available():
        return {"device": "cpu", "name": "cpu", "memory_gb": None, "cap_gb": None}
    props = torch.cuda.get_device_properties(0)
    cap = None
    if props.total_memory > A100_BYTES * 1.02:
        torch.cuda.set_per_process_memory_fraction(A100_BYTES / props.total_memory)
        cap = 80.0
    return {"device": "cuda", "name": props.name, "memory_gb": round(props.total_memory / 2**30, 1), "cap_gb": cap}


def _workdir(need_bytes: int) -> Path:
    """Where the random models are written: RAM-backed /dev/shm when it has room, else the temp folder."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            if shutil.disk_usage(base).free > need_bytes * 1.2:
                return Path(tempfile.mkdtemp(prefix="m1-gpu-check-", dir=base))
        except OSError:
            continue
    raise RuntimeError(f"no folder with {need_bytes / 2**30:.1f} GiB free for the random model")


def write_random_model(shape, folder: Path, device: str) -> Path:
    """A random-initialised causal LM of `shape` saved as a model folder, with M1's offline tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from m1.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = shape.hf_config(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    _free()
    return folder


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_gb(reset: bool = False) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return round(peak, 2)


def _samples(n_questions: int, k: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> list:
    """A GRPO step's samples: K completions per question sharing its prompt, advantages normalised per group."""
    import torch

    from m1.marl.rollout.episodes import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for q in range(n_questions):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        rewards = torch.randn(k, generator=g)
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-4)).tolist()
        for r in range(k):
            out.append(Sample(agent="qwen3_8b", question_id=f"q{q}", group=q, rollout=r, phase="answer",
                              prompt_ids=prompt, completion_ids=torch.randint(10, vocab, (completion_len,),
                                                                             generator=g).tolist(),
                              logprobs=None, reward=float(rewards[r]), advantage=adv[r], temperature=1.0))
    return out


class Check:
    """Runs the steps, recording each one's numbers or its error."""

    def __init__(self, tiny: bool, partial: Path | None = None):
        self.tiny, self.partial = tiny, partial
        self.result: dict = {"mode": "tiny" if tiny else "paper", "versions": _versions(), "steps": {}}

    def step(self, name: str, fn):
        t0 = time.perf_counter()
        try:
            out = fn() or {}
            out = {"ok": True, **out}
        except Exception as exc:  # recorded, not swallowed: the step's ok is false and the exit status says so
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=4)[-1500:]}
        out["seconds"] = round(time.perf_counter() - t0, 2)
        self.result["steps"][name] = out
        print(f"[gpu_check] {name}: {'ok' if out['ok'] else out['error']} ({out['seconds']} s)", file=sys.stderr,
              flush=True)
        if self.partial is not None:  # what was measured survives a run stopped by a time limit
            self.partial.write_text(json.dumps(self.result, indent=1))
        return out


def learner_config(name: str, tiny: bool, have_deepspeed: bool):
    """The learner and GRPO settings of a shipped MARL config (tiny: the same with small lengths)."""
    from m1.marl.config import load_train_config

    cfg = load_train_config(name)
    learner = cfg.learner
    if not have_deepspeed:
        learner = learner.model_copy(update={"deepspeed": None})
    if tiny:
        learner = learner.model_copy(update={"max_prompt_tokens": 32, "max_completion_tokens": 16})
    return learner, cfg.grpo


def run(tiny: bool, only_full: bool = False, skip_full: bool = False, partial: Path | None = None) -> dict:
    import torch

    from m1.config import ModelSpec
    from m1.marl.actor.learner import AgentLearner
    from m1.marl.actor.learner_io import load_actor, save_actor
    from m1.models.shapes import TEXT_SHAPES, TextShape

    check = Check(tiny, partial)
    res = check.result
    res["device"] = _device_info(tiny)
    device = res["device"]["device"]
    have_ds = res["versions"]["deepspeed"] is not None
    if not have_ds:
        res["note"] = "DeepSpeed is not installed: the learner ran in plain torch (pip install deepspeed==0.19.8)"
    if tiny:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    paper8b = TEXT_SHAPES["Qwen/Qwen3-8B"]
    shape8b = TextShape("qwen3", 64, 2, 4, 2, 16, 128, 1024, False, 4096) if tiny else paper8b
    shape3b = (TextShape("qwen2", 64, 2, 4, 2, 16, 128, 1024, True, 4096) if tiny
               else TEXT_SHAPES["Qwen/Qwen2.5-3B-Instruct"])
    prompt_len, new_tokens = (32, 16) if tiny else (1000, 1024)
    step_prompt, step_completion = (32, 16) if tiny else (1024, 1024)
    n_questions, k = (2, 2) if tiny else (8, 4)
    res["shapes"] = {"lora_agent": {"hidden": shape8b.hidden_size, "layers": shape8b.num_hidden_layers,
                                    "heads": shape8b.num_attention_heads, "kv_heads": shape8b.num_key_value_heads,
                                    "vocab": shape8b.vocab_size, "parameters": shape8b.parameters()},
                     "full_agent": {"hidden": shape3b.hidden_size, "layers": shape3b.num_hidden_layers,
                                    "parameters": shape3b.parameters()}}
    work = _workdir(2 * shape8b.parameters() + 2 * 2**30)
    res["workdir"] = str(work)
    state: dict = {}
    try:
        if only_full:
            check.step("full_3b", lambda: full_3b(shape3b, work, device, tiny, have_ds, n_questions, k, step_prompt,
                                                   step_completion))
            return res

        def build_lora():
            folder = write_random_model(shape8b, work / "qwen3_8b", device)
            cfg, grpo = learner_config("videochat_m1_lora", tiny, have_ds)
            spec = ModelSpec(interface="chat", backend="hf", path=str(folder), dtype="bfloat16", attn_implementation="sdpa",
                             device="cpu" if tiny else "auto")
            if tiny:  # bf16 on CPU: the same dtypes as on the GPU
                cfg = cfg.model_copy(update={"precision": "bf16"})
            t0 = time.perf_counter()
            learner = AgentLearner.build("qwen3_8b", "qwen3_8b", spec, cfg, grpo, seed=0)
            state["learner"] = learner
            return {"load_seconds": round(time.perf_counter() - t0, 2), "deepspeed": learner.actor.engine is not None,
                    "weights_dtype": learner.actor.weights_dtype, "peak_gb": _peak_gb(reset=True)}

        if not check.step("lora_learner", build_lora)["ok"]:
            return res
        learner = state["learner"]

        def generate(batch: int):
            def fn():
                policy = learner.actor.policy
                policy.eval()
                g = torch.Generator().manual_seed(batch)
                ids = torch.randint(10, 1000, (batch, prompt_len), generator=g).to(learner.actor.device)
                _peak_gb(reset=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode(), learner.actor.autocast():
                    out = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          temperature=1.0, top_k=0, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, pad_token_id=learner.actor.tokenizer.pad_token_id)
                if device == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                made = int(out.shape[1] - prompt_len) * batch
                return {"prompts": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
                        "tokens_per_s": round(made / dt, 1), "peak_gb": _peak_gb(reset=True)}
            return fn

        check.step("generate_8", generate(8))
        check.step("generate_32", generate(32))

        vocab = min(shape8b.vocab_size, 150_000)
        batch1 = _samples(n_questions, k, step_prompt, step_completion, vocab, seed=1)
        batch2 = _samples(n_questions, k, step_prompt, step_completion, vocab, seed=2)

        def lora_update():
            named = dict(learner.actor.policy.named_parameters())
            lora = {n: p for n, p in named.items() if p.requires_grad}
            base = {n: p for n, p in named.items() if not p.requires_grad}
            assert lora and all("lora_" in n for n in lora), f"trainable parameters that are not LoRA: {list(lora)[:3]}"
            base_dtypes = sorted({str(p.dtype) for p in base.values()})
            assert base_dtypes == ["torch.bfloat16"], f"base weights are {base_dtypes}, not bf16"
            masters = _master_dtypes(learner)
            assert masters == ["torch.float32"], f"LoRA master weights are {masters}, not fp32"
            probe_base = {n: p.detach().clone() for n, p in list(base.items())[:: max(1, len(base) // 16)]}
            before = {n: p.detach().float().clone() for n, p in lora.items()}
            _peak_gb(reset=True)
            stats = learner.actor.update(batch1, cfg_lr(learner))
            assert math.isfinite(stats["loss"]), f"loss {stats['loss']}"
            changed = sum(not torch.equal(before[n], p.detach().float()) for n, p in lora.items())
            b_changed = sum(not torch.equal(before[n], p.detach().float()) for n, p in lora.items() if "lora_B" in n)
            n_b = sum("lora_B" in n for n in lora)
            assert b_changed == n_b, f"{n_b - b_changed} of {n_b} lora_B matrices did not move"
            moved_base = [n for n, p in probe_base.items() if not torch.equal(p, named[n].detach())]
            assert not moved_base, f"frozen weights changed: {moved_base[:3]}"
            return {"loss": stats["loss"], "kl": stats.get("kl"), "grad_norm": stats["grad_norm"],
                    "samples": len(batch1), "tokens": int(stats["tokens"]) + len(batch1) * step_prompt,
                    "base_dtype": base_dtypes[0], "master_dtype": masters[0], "lora_tensors": len(lora),
                    "lora_tensors_changed_in_bf16_view": changed, "base_probes_unchanged": len(probe_base),
                    "peak_gb": _peak_gb(reset=True)}

        check.step("grpo_update", lora_update)

        def resume():
            ckpt = work / "ckpt"
            save_actor(learner.actor, ckpt, include_rng=True)
            first = learner.actor.update(batch2, cfg_lr(learner))["loss"]
            load_actor(learner.actor, ckpt, include_rng=True)
            again = learner.actor.update(batch2, cfg_lr(learner))["loss"]
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            assert math.isfinite(first) and abs(first - again) <= 1e-5 * max(1.0, abs(first)), (first, again)
            return {"loss_after_save": first, "loss_after_reload": again, "checkpoint_mb": round(size / 2**20, 1)}

        check.step("resume", resume)
        learner = None
        state.clear()
        _free()
        shutil.rmtree(work / "qwen3_8b", ignore_errors=True)

        if not skip_full:
            check.step("full_3b", lambda: full_3b(shape3b, work, device, tiny, have_ds, n_questions, k, step_prompt,
                                                   step_completion))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def full_3b(shape3b, work: Path, device: str, tiny: bool, have_ds: bool, n_questions: int, k: int,
            step_prompt: int, step_completion: int) -> dict:
    """Full fine-tuning of a Qwen2.5-3B shape under ZeRO-2 on one GPU, as videochat_m1_full.yaml builds it."""
    import torch

    from m1.config import ModelSpec
    from m1.marl.actor.learner import AgentLearner

    folder = write_random_model(shape3b, work / "qwen25_3b", device)
    cfg, grpo = learner_config("videochat_m1_full", tiny, have_ds)
    spec = ModelSpec(interface="chat", backend="hf", path=str(folder), dtype="bfloat16", attn_implementation="sdpa",
                     device="cpu" if tiny else "auto")
    if tiny:
        cfg = cfg.model_copy(update={"precision": "bf16"})
    _peak_gb(reset=True)
    try:
        full = AgentLearner.build("qwen25_3b", "qwen25_3b", spec, cfg, grpo, seed=0)
        loaded = _peak_gb()
        masters_before = _master_copy(full)
        stats = full.actor.update(_samples(n_questions, k, step_prompt, step_completion,
                                     min(shape3b.vocab_size, 150_000), seed=3), cfg.learning_rate())
    except torch.OutOfMemoryError as exc:
        return {"fits": False, "error": str(exc).splitlines()[0], "peak_gb": _peak_gb(reset=True)}
    assert math.isfinite(stats["loss"]), f"loss {stats['loss']}"
    masters_after = _master_copy(full)
    moved = masters_before is not None and not torch.equal(masters_before, masters_after)
    out = {"fits": True, "loss": stats["loss"], "deepspeed_zero2": full.actor.engine is not None,
           "weights_dtype": full.actor.weights_dtype,
           "reference_dtype": str(next(full.actor.ref.parameters()).dtype) if full.actor.ref is not None else None,
           "fp32_masters_moved": moved, "peak_after_load_gb": loaded, "peak_gb": _peak_gb(reset=True),
           "update_seconds": round(stats["seconds"], 2)}
    del full
    _free()
    return out


def cfg_lr(learner) -> float:
    return learner.actor.cfg.learning_rate()


def _masters(learner) -> list:
    """The weights the optimizer steps: DeepSpeed's fp32 partitions, or the trainable tensors."""
    opt = getattr(learner.actor.engine, "optimizer", None) if learner.actor.engine is not None else None
    return getattr(opt, "single_partition_of_fp32_groups", None) or learner.actor.optim.params


def _master_dtypes(learner) -> list[str]:
    return sorted({str(t.dtype) for t in _masters(learner)})


def _master_copy(learner):
    """A flat copy of the first few million master values (to see a 1e-7 step that bf16 weights cannot show)."""
    import torch

    return torch.cat([t.detach().reshape(-1)[:1_000_000].float() for t in _masters(learner)]).cpu().clone()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny models on CPU (what the test suite runs)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--skip-full", action="store_true", help="leave out the Qwen2.5-3B full fine-tuning step")
    which.add_argument("--only-full", action="store_true", help="run only the Qwen2.5-3B full fine-tuning step")
    ap.add_argument("--json", type=Path, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines go to stderr: stdout is the JSON alone
        result = run(args.tiny, args.only_full, args.skip_full, args.json)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = bool(result["steps"]) and all(s["ok"] for s in result["steps"].values())
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
