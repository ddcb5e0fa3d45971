"""`m1 pretrain`: a student trained from scratch to read the synth world's texts, once, then shipped as a base.

Each step draws a fresh batch by the config's mix: reading drills (m1/pretrain/drills.py, written from worlds whose
seeds evaluation never uses) and plain next-token modelling on the world's texts (a rule-based teacher team's
prompts and replies: captions, tool outputs, memory notes). The loss is next-token cross-entropy over every token of
a sequence plus, weighted, over its target. Held-out drills are graded by greedy decoding every `eval.every` steps.

Resumable like an experiment stage: `checkpoint.pt` holds the weights, the optimizer, the step, every random state,
the CPU seconds spent so far and the metrics of the steps since the last row (the next row logs their means);
`metrics.jsonl` keeps one row per evaluation and a rerun drops rows past the checkpoint, so a killed run resumes with
the rows of an uninterrupted one, none duplicated or lost. SIGTERM/SIGINT finish the step, checkpoint and stop (exit
143/130). The finished base is `<out_dir>/base/` (weights and tokenizer, loadable as a model `path`)
with `record.json` (the config, steps, curves' last rows, held-out accuracy per family, core-hours).
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

from m1.attention_loss import HeadScores, evidence_attention_loss, supervised_layers
from m1.evidence import token_evidence
from m1.files import check_place
from m1.marl.checkpoint import StopFlag, save_state_file
from m1.marl.config import scheduled_lr
from m1.marl.actor.learner_io import rng_state, set_rng_state
from m1.marl.loop import run_steps
from m1.pretrain.config import TEXT, PretrainConfig
from m1.pretrain.drills import Drill, DrillSource

CHECKPOINT = "checkpoint.pt"


def grade(drill: Drill, generated: str) -> bool:
    """Whether the first line the student wrote ends with the drill's answer (at a word or bracket boundary): the
    quoted steps before it are how it got there, not what is graded."""
    line, answer = generated.split("\n")[0].rstrip(), drill.answer.strip()
    return line.endswith(answer) and (len(line) == len(answer) or line[-len(answer) - 1] in " >:")


def _means(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's mean over the rows that have it (a step of texts alone has no attention figures)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: round(sum(r[k] for r in rows if k in r) / sum(k in r for r in rows), 4) for k in keys}


class Pretrainer:
    def __init__(self, cfg: PretrainConfig, progress: Callable[[str], None] = print):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from m1.models.tiny import ensure_tiny

        self.cfg, self.progress = cfg, progress
        self.out = Path(cfg.out_dir)
        check_place(self.out, "out_dir", folder=True)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(cfg.threads)
        folder = ensure_tiny(cfg.student)
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.tok.padding_side = "left"
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.train_drills = DrillSource("train", cfg.seed, cfg.world_duration)
        self.rng = random.Random(cfg.seed + 1)  # the mix's draws
        self.step, self.cpu_seconds, self.checkpointed = 0, 0.0, 0
        self.history: list[dict[str, Any]] = []  # the rows this process logged (the step loop's)
        self.tracker_ids: dict[str, str] = {}
        self.trackers, self.learners, self.placement = None, None, None  # the step loop's; no learner groups here
        self._cpu_started, self._wall, self._recent = time.process_time(), time.time(), []
        self._texts: list[list[int]] | None = None
        self._eval_sets: dict[tuple[int, int, str], dict[str, list[Drill]]] = {}
        self._resume()

    # ------------------------------------------------------------------------------------------ data
    def texts(self) -> list[list[int]]:
        """The world's texts as token ids, written once per out_dir (a teacher team's run, ~1 min)."""
        if self._texts is None:
            path = self.out / "texts.json"
            if not path.is_file():
                import tempfile

                from m1.synth.corpus import seed_kinds_corpus

                with tempfile.TemporaryDirectory() as tmp:
                    texts = seed_kinds_corpus(Path(tmp) / "world")
                tmp_path = path.with_suffix(".tmp")
                tmp_path.write_text(json.dumps(texts))
                os.replace(tmp_path, path)
            texts = json.loads(path.read_text())
            self._texts = [ids for ids in self.tok(texts, add_special_tokens=False)["input_ids"] if len(ids) > 8]
        return self._texts

    def _encode(self, drill: Drill) -> tuple[list[int], int, list[tuple[int, tuple[int, ...]]]]:
        """The drill's ids, where its target starts, and its evidence rows (query position, evidence positions)."""
        prompt = self.tok(drill.prompt, add_special_tokens=False, return_offsets_mapping=True)
        target = self.tok(drill.target + "\n", add_special_tokens=False, return_offsets_mapping=True)
        shift = len(drill.prompt)
        offsets = list(prompt["offset_mapping"]) + [(a + shift, b + shift) for a, b in target["offset_mapping"]]
        start = len(prompt["input_ids"])
        rows = token_evidence(offsets, drill.evidence, first=start) if self.cfg.attention.on else []
        return prompt["input_ids"] + target["input_ids"], start, rows

    def batch(self) -> list[tuple[list[int], int, list]]:
        """(ids, where the target starts (len(ids) for texts), evidence rows) for one step, by the mix."""
        mix = self.cfg.mix_at(self.step)
        names = [k for k, w in mix.items() if w > 0]
        weights = [mix[k] for k in names]
        frames = self.cfg.frames_at(self.step)
        out = []
        while len(out) < self.cfg.batch_size:
            family = self.rng.choices(names, weights)[0]
            if family == TEXT:  # a window of one of the world's texts
                ids = self.rng.choice(self.texts())
                at = self.rng.randrange(max(1, len(ids) - self.cfg.text_tokens + 1))
                ids = ids[at: at + self.cfg.text_tokens]
                out.append((ids, len(ids), []))
                continue
            ids, start, rows = self._encode(self.train_drills.draw(family, frames, self.cfg.steps_written))
            if len(ids) <= self.cfg.max_tokens:
                out.append((ids, start, rows))
        return out

    # ------------------------------------------------------------------------------------------ training
    def lr_at(self, step: int) -> float:
        """Warm-up, then cosine decay to lr * min_lr_ratio: the schedule MARL and SFT use (m1/marl/config.py)."""
        cfg = self.cfg
        return scheduled_lr(cfg.lr, step, cfg.steps, cfg.warmup, "cosine", cfg.min_lr_ratio)

    def train_step(self) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        rows = self.batch()
        width = max(len(ids) for ids, _, _ in rows)
        pad = self.tok.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r, _, _ in rows])  # padded on the right
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _, _ in rows])
        labels = ids.clone()
        labels[mask == 0] = -100
        target = torch.full_like(labels, -100)
        for b, (r, start, _) in enumerate(rows):
            target[b, start:len(r)] = labels[b, start:len(r)]
        att = self.cfg.attention
        with HeadScores(self.model, supervised_layers(att) if att.on else []) as heads:
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        shown = evidence_attention_loss(heads, att, [ev for _, _, ev in rows], mask) if att.on else None
        flat = logits.reshape(-1, logits.shape[-1])
        nll = F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none")  # one softmax
        real, is_target = labels[:, 1:].reshape(-1) != -100, target[:, 1:].reshape(-1) != -100
        every = nll[real].mean()
        tgt = nll[is_target].mean() if bool(is_target.any()) else every * 0
        loss = every + self.cfg.target_weight * tgt + (shown.loss if shown else 0)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": every.item(), "target_loss": tgt.item(), "grad_norm": norm.item(),
                **(shown.metrics if shown else {})}

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, drills_per_family: int, seed: int = 12345, split: str = "dev") -> dict[str, float]:
        """Accuracy per family on `split` (dev during training, held-out for the record): greedy decoding of each
        drill's target, graded on its last step. The same drills at every evaluation (worlds drawn from `seed`)."""
        import torch

        key = (drills_per_family, seed, split)
        if key not in self._eval_sets:  # drawn once: every evaluation grades the same drills
            source = DrillSource(split, seed, self.cfg.world_duration)
            self._eval_sets[key] = {f: [source.draw(f, self.cfg.eval.frames, self.cfg.steps_written)
                                        for _ in range(drills_per_family)] for f in self.cfg.eval.families}
        self.model.eval()
        acc = {}
        try:
            for family, drills in self._eval_sets[key].items():
                hits = 0
                for i in range(0, len(drills), 32):
                    chunk = drills[i:i + 32]
                    longest = max(len(self.tok(d.target)["input_ids"]) for d in chunk) + 2
                    enc = self.tok([d.prompt for d in chunk], return_tensors="pt", padding=True,
                                   add_special_tokens=False)
                    with torch.no_grad():
                        out = self.model.generate(**enc, max_new_tokens=longest, do_sample=False,
                                                  pad_token_id=self.tok.pad_token_id)
                    texts = self.tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                    hits += sum(grade(d, t) for d, t in zip(chunk, texts))
                acc[family] = hits / len(drills)
        finally:
            self.model.train()
        return acc

    # ------------------------------------------------------------------------------------------ state
    def _resume(self) -> None:
        import torch

        path = self.out / CHECKPOINT
        if not path.is_file():
            return
        state = torch.load(path, weights_only=False)
        # read through today's model, so that a setting added since (with its default) does not refuse the resume
        if PretrainConfig.model_validate(state["config"]).model_dump(mode="json") != self.cfg.model_dump(mode="json"):
            raise ValueError(f"{path}: written by another config; use a new out_dir or the same config to resume")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.cpu_seconds = state["step"], state["cpu_seconds"]
        self.checkpointed, self.tracker_ids = self.step, state.get("tracker_ids", {})
        self.rng.setstate(state["mix_rng"])
        self.train_drills.rng.setstate(state["drill_rng"])
        # the steps since the last row, whose means the next row logs (a checkpoint between rows holds some)
        self._recent = list(state.get("recent", []))
        if "rng" in state:
            set_rng_state(state["rng"])
        else:  # a checkpoint written before the process RNG states were kept whole: torch's alone
            torch.set_rng_state(state["torch_rng"])
        self.progress(f"pretrain: resuming {self.out} at step {self.step}")

    def cpu_now(self) -> float:
        """CPU seconds of every run of this out_dir so far."""
        return self.cpu_seconds + time.process_time() - self._cpu_started

    def save_checkpoint(self, interim: bool = False) -> Path:
        """`checkpoint.pt`, written atomically: weights, optimizer, step, CPU seconds, every random state and the
        metrics of the steps not yet logged (one file, so an interim checkpoint of a stopped run is the same file)."""
        state = {"config": self.cfg.model_dump(mode="json"), "model": self.model.state_dict(),
                 "optimizer": self.opt.state_dict(), "step": self.step, "cpu_seconds": self.cpu_now(),
                 "mix_rng": self.rng.getstate(), "drill_rng": self.train_drills.rng.getstate(), "rng": rng_state(),
                 "recent": list(self._recent), "tracker_ids": self.tracker_ids}
        save_state_file(state, self.out / CHECKPOINT)
        self.checkpointed = self.step
        return self.out / CHECKPOINT

    # ------------------------------------------------------------------------------------------ the run
    def logged_step(self) -> dict[str, Any] | None:
        """One training step; after every `eval.every`-th and the last, the evaluation's row (the steps' means
        since the last row, the dev accuracy per family), else None."""
        cfg = self.cfg
        self._recent.append(self.train_step())
        if self.step % cfg.eval.every and self.step != cfg.steps:
            return None
        acc = self.evaluate(cfg.eval.drills)
        row = {"step": self.step, "frames": cfg.frames_at(self.step), **_means(self._recent),
               "lr": self.lr_at(self.step - 1), "cpu_s": round(self.cpu_now(), 1),
               "wall_s": round(time.time() - self._wall, 1), "dev": acc}
        self._recent = []
        return row

    def run(self, stop: StopFlag | None = None, stop_after: int | None = None) -> dict[str, Any] | None:
        """Train to `cfg.steps` from the checkpoint if any, in the step loop MARL and SFT use (m1/marl/loop.py:
        metrics.jsonl, trackers, checkpoints, `stop` set by a signal); the record, or None when it stopped early."""
        self._cpu_started, self._wall = time.process_time(), time.time()
        run_steps(self, self.cfg.steps, self.logged_step, "pretrain step", stop_after=stop_after, stop=stop)
        return self.finish(self.cpu_now()) if self.step == self.cfg.steps else None

    def finish(self, cpu_seconds: float) -> dict[str, Any]:
        """Save the base and its record (held-out accuracy on `eval.final_drills` per family)."""
        base = self.out / "base"
        self.model.save_pretrained(base)
        self.tok.save_pretrained(base)
        acc = self.evaluate(self.cfg.eval.final_drills, seed=54321, split="held_out")
        rows = [json.loads(r) for r in (self.out / "metrics.jsonl").read_text().splitlines() if r]
        record = {"config": self.cfg.recorded(), "steps": self.step, "held_out": acc,
                  "graded": {f: acc[f] for f in self.cfg.graded}, "cpu_seconds": round(cpu_seconds, 1),
                  "core_hours": round(cpu_seconds / 3600, 3),
                  "threads": self.cfg.threads, "curve": rows,
                  "params": sum(p.numel() for p in self.model.parameters())}
        (base / "record.json").write_text(json.dumps(record, indent=1) + "\n")
        self.progress(f"pretrain: base in {base}; held-out " +
                      ", ".join(f"{k} {v:.1%}" for k, v in acc.items()) + f"; {record['core_hours']} core-hours")
        return record


def pretrain_main(config_path: str | Path, overrides: list[str] | None = None,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """`m1 pretrain --config PATH --set key=value ...`: train (or resume) a base; SIGTERM / SIGINT finish the step,
    checkpoint it and raise TrainingStopped (exit 143 / 130); a rerun resumes."""
    from m1.marl.checkpoint import TrainingStopped, stop_on_signals
    from m1.pretrain.config import load_pretrain_config

    cfg = load_pretrain_config(config_path, overrides)
    with stop_on_signals() as flag:
        trainer = Pretrainer(cfg, progress)
        progress(f"pretrain: {cfg.steps} steps of {cfg.batch_size} into {trainer.out} (starting at {trainer.step})")
        record = trainer.run(stop=flag)
        if record is None:
            progress(f"pretrain: {flag.name} received; step {trainer.step} is checkpointed in "
                     f"{trainer.out / CHECKPOINT}")
            raise TrainingStopped(trainer.step, flag, trainer.out / CHECKPOINT)
    return record
