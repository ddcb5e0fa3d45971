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
from m1.models.base import text_only
from m1.registry import seed_kinds
from m1.synth.make import make_dataset
from m1.synth.questions import MOTION_TEXT, RELATIONS
from m1.synth.world import BACKGROUNDS, CELLS, COLOURS, MOTIONS, SHAPES, SIZES
from m1.team.cpp import Team
from m1.team.single import SingleAgentTeam


# The words a reading student looks up (m1/models/tiny.py `reading_tokenizer` never merges them into a phrase): the
# world's colours, backgrounds, shapes, sizes, motions, positions and relations.
LOOKUP_WORDS = frozenset(w for text in (*COLOURS, *BACKGROUNDS, *SHAPES, *SIZES, *MOTIONS, *CELLS.values(),
                                        *RELATIONS, *MOTION_TEXT.values()) for w in text.split())

# a tiny random CLIP for retrieval: its notes read like the world's trained CLIP's, at no training cost
CORPUS_CLIP = {"interface": "clip", "backend": "open_clip", "device": "cpu",
               "tiny": {"arch": "open_clip", "hidden_size": 64, "layers": 2, "image_size": 64, "seed": 6}}


def _world(workdir: Path, videos: int, seed: int, duration: float):
    qfile = make_dataset(Path(workdir), videos, seed, duration=duration, questions_per_video=12, progress=False)
    questions, issues = read_questions(qfile, qfile.parent)
    if issues or not questions:
        raise ModelError(f"synth tokenizer corpus: bad questions in {qfile}: {issues[:3]}")
    return questions


def synth_corpus(workdir: Path, videos: int = 4, seed: int = 424242, duration: float = 120.0) -> list[str]:
    """Prompts and replies of a rule-based teacher team on a small M1-Synth world.

    Every phase's real prompt (plan, communicate, answer, summary) with real tool notes (a tiny
    random CLIP for retrieval, the pixel-reading synth vision model for browsing), so the
    tokenizer learns the words and lines the mini team reads. The world seed is fixed and apart
    from any training or evaluation seed; the built-in corpus is appended for general coverage.
    """
    return _cpp_texts(_world(workdir, videos, seed, duration)) + _default_corpus()


def _cpp_texts(questions) -> list[str]:
    teachers = {f"t{i}": {"interface": "chat", "backend": "synth", "error_rate": rate, "seed": i}
                for i, rate in enumerate((0.0, 0.1, 0.2, 0.3))}
    budget = SYNTH_BROWSER_TOKENS
    cfg = TeamConfig.model_validate({
        "name": "corpus",
        "models": {**teachers, "vision": {"interface": "vision", "backend": "synth"}, "clip": CORPUS_CLIP},
        "agents": [{"name": name, "model": f"t{i}"} for i, name in enumerate(SYNTH_AGENTS)],
        "tools": {"browser": "vision", "clip": "clip", "rough_tokens": budget, "fine_tokens": budget,
                  "space_tokens": budget, "grounding_tokens": budget},
        "limits": {"max_turns": 4, "batch_episodes": 16}})
    texts: list[str] = []
    for ep in Team(cfg).run(questions):
        for gen in ep.generations:
            texts += [m["content"] for m in gen.prompt if isinstance(m.get("content"), str)]
            texts.append(gen.completion)
    return texts


def seed_kind_loops() -> list[tuple[str, dict]]:
    """The seed kinds in the corpus and the `seed_system` settings their chats are written with (SeedKindSpec
    corpus_loop), in registration order: the loop as their mini policies run it (configs/sft/<kind>_synth.yaml:
    described frames, a 16-frame glance, short tool results). Written in the kinds' specs, not read from those
    configs, so that editing a config never changes a tokenizer quietly; CORPUS_VERSIONS in m1/models/tiny.py names
    this recipe, and a kind registered without a corpus_loop leaves it as it is."""
    return [(name, dict(spec.corpus_loop)) for name, spec in seed_kinds().items() if spec.corpus_loop is not None]


def seed_kinds_corpus(workdir: Path, videos: int = 4, seed: int = 424242, duration: float = 120.0) -> list[str]:
    """The synth corpus plus the seed kinds' rule-based chats (Weaver, VideoZoomer, SAGE) on the same world, as a
    text policy reads them (frames as their descriptions, `text_only`): their system prompts, tool-call JSON and
    observation lines become short token runs, which the CPP team's prompts alone do not teach (a Weaver tool call
    is 69 tokens for a synth tokenizer trained on those prompts alone)."""
    questions = _world(workdir, videos, seed, duration)
    texts = _cpp_texts(questions) + _default_corpus()
    for kind, loop in seed_kind_loops():
        cfg = TeamConfig.model_validate({
            "name": f"corpus_{kind}",
            "models": {"policy": {"interface": "chat", "backend": "synth"},
                       "vision": {"interface": "vision", "backend": "synth"}, "clip": CORPUS_CLIP},
            "agents": [{"name": kind, "model": "policy", "kind": kind}],
            "tools": {"clip": "clip", "browser": "vision"},
            "seed_system": {**loop, "captioner": "vision"}, "limits": {"batch_episodes": 16}})
        for ep in SingleAgentTeam(cfg).run(questions):
            for gen in ep.generations:
                texts += [m["content"] for m in text_only(gen.prompt) if isinstance(m.get("content"), str)]
                texts.append(gen.completion)
    return texts
