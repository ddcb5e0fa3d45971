"""The text the M1-Synth tokenizer is trained on: a rule-based teacher team's prompts and replies on a small world.

m1/models/tiny.py builds the tokenizer and finds this function by name (`CORPORA`), so the models package never
imports the synthetic world.
"""
from __future__ import annotations

from pathlib import Path

from m1.config import TeamConfig
from m1.data.questions import read_questions
from m1.models.base import ModelError
from m1.models.tiny import SYNTH_AGENTS, SYNTH_BROWSER_TOKENS, _default_corpus
from m1.synth.make import make_dataset
from m1.team.cpp import Team


def synth_corpus(workdir: Path, videos: int = 4, seed: int = 424242, duration: float = 120.0) -> list[str]:
    """Prompts and replies of a rule-based teacher team on a small M1-Synth world.

    Every phase's real prompt (plan, communicate, answer, summary) with real tool notes (a tiny
    random CLIP for retrieval, the pixel-reading synth vision model for browsing), so the
    tokenizer learns the words and lines the mini team reads. The world seed is fixed and apart
    from any training or evaluation seed; the built-in corpus is appended for general coverage.
    """
    qfile = make_dataset(Path(workdir), videos, seed, duration=duration, questions_per_video=12, progress=False)
    questions, issues = read_questions(qfile, qfile.parent)
    if issues or not questions:
        raise ModelError(f"synth tokenizer corpus: bad questions in {qfile}: {issues[:3]}")
    teachers = {f"t{i}": {"kind": "chat", "backend": "synth", "error_rate": rate, "seed": i}
                for i, rate in enumerate((0.0, 0.1, 0.2, 0.3))}
    clip = {"kind": "clip", "backend": "open_clip", "device": "cpu",
            "tiny": {"arch": "open_clip", "hidden_size": 64, "layers": 2, "image_size": 64, "seed": 6}}
    budget = SYNTH_BROWSER_TOKENS
    cfg = TeamConfig.model_validate({
        "name": "corpus", "models": {**teachers, "vision": {"kind": "vision", "backend": "synth"}, "clip": clip},
        "agents": [{"name": name, "model": f"t{i}"} for i, name in enumerate(SYNTH_AGENTS)],
        "tools": {"browser": "vision", "clip": "clip", "rough_tokens": budget, "fine_tokens": budget,
                  "space_tokens": budget, "grounding_tokens": budget},
        "limits": {"max_turns": 4, "batch_episodes": 16}})
    texts: list[str] = []
    for ep in Team(cfg).run(questions):
        for gen in ep.generations:
            texts += [m["content"] for m in gen.prompt if isinstance(m.get("content"), str)]
            texts.append(gen.completion)
    return texts + _default_corpus()
