"""The students' reading: their tokenizer (the same words are the same tokens in every role), the reading drills
(answerable by a rule from the prompt alone) and `m1 pretrain` (trains, evaluates, resumes exactly)."""
import json
import random
import re

import pytest

from m1.pretrain.drills import CHAINS, FAMILIES, Drill, DrillSource, make_drill
from m1.synth.world import make_script


# ------------------------------------------------------------------------------------------------ drills
def rule_answer(drill: Drill) -> str:
    """What a hand-written reader answers: the check that the drills are answerable from their prompts alone."""
    p = drill.prompt
    if drill.family == "clock":
        m, s = re.search(r"(\d\d):(\d\d)", p).groups()
        return f" {int(m) * 60 + int(s)}"
    opts = dict(re.findall(r"^([ABCD]): (.+)$", p, re.M))
    pick = (lambda v: " " + next(k for k, o in opts.items() if o == v))
    if drill.family == "option":
        return pick(re.search(r"Which option says (.+)\?", p).group(1))
    if drill.family in ("span", "grounding"):
        name = re.search(r"(?:When is the|written for the) (.+?)(?: on screen)?\?", p).group(1)
        return " " + re.search(rf"The {name} is seen .*?##Timestamp: (\[[^\]]+\])", p).group(1)
    frames = re.findall(r"<frame \d+ at ([\d.]+)s>\[([^\]]*)\]", p)
    if drill.family in ("find", "attribute"):
        name = re.search(r"Where (?:is|in the frame does) the (\w+ \w+)", p).group(1)
        pos = next(re.search(rf"{name} at the (\w+ \w+)", cap).group(1) for _, cap in frames if name in cap)
        return f" {pos}" if drill.family == "find" else pick(pos)
    if drill.family == "at_time":
        sec = int(re.search(r"at (\d+) seconds", p).group(1))
    else:
        m, s = re.search(r"appears at (\d\d):(\d\d)", p).groups()
        sec = int(m) * 60 + int(s)
    cap = next(cap for t, cap in frames if int(float(t)) == sec)
    colour = re.search(r"an? \w+ (\w+) ", cap).group(1)
    return f" {colour}" if drill.family == "at_time" else pick(colour)


@pytest.mark.parametrize("steps", [False, True])
def test_every_drill_is_answered_by_a_rule_reading_its_prompt(steps):
    """The data is right: a hand-written reader of the prompt gets every drill of every family."""
    src = DrillSource("train", seed=3)
    for family in FAMILIES:
        for _ in range(60):
            d = src.draw(family, frames=16, steps=steps)
            assert rule_answer(d) == d.answer, (family, d.prompt[-400:], d.target)
            assert d.target.startswith(" ") and d.target.endswith(d.answer)


def test_chains_write_their_steps_before_the_answer():
    rng = random.Random(0)
    script = make_script(7, duration=120.0)
    seen = {}
    while len(seen) < 3:
        for family in CHAINS:
            d = make_drill(family, script, rng, frames=16, steps=True)
            if d is not None:
                seen[family] = d
    att, ts, gr = seen["attribute"], seen["timestamp"], seen["grounding"]
    # each lookup quotes the context: the caption after the object's name, the frame at that second, the note
    assert att.target.count("->") == 1 and att.target.split(" ->")[0] in att.prompt
    assert ts.target.count("->") == 3  # seconds -> the frame, quoted -> its colour -> the letter
    assert ts.target.split(" -> ")[1] in ts.prompt
    assert gr.target.startswith(" The ") and gr.target.endswith(gr.answer) and gr.target[1:] in gr.prompt


def test_grading_reads_the_answer_at_the_end_of_the_first_line():
    from m1.pretrain.drills import Drill
    from m1.pretrain.train import grade

    d = Drill("attribute", "...", " red cross at the bottom left -> C", " C")
    assert grade(d, " red cross at the bottom left -> C\nmore")
    assert grade(d, " C") and not grade(d, " blue cross at the top left -> B") and not grade(d, " red cross -> AC")
    g = Drill("grounding", "...", " [1.0 - 2.0]", " [1.0 - 2.0]")
    assert grade(g, " The red cross is seen from 00:01 to 00:02. ##Timestamp: [1.0 - 2.0]")
    assert not grade(g, " [1.0 - 2.5]")


def test_held_out_worlds_are_never_drawn_in_training_or_dev():
    train, dev, held = (DrillSource(s, seed=0) for s in ("train", "dev", "held_out"))
    assert not set(train.seeds) & set(held.seeds) and not set(dev.seeds) & set(held.seeds)
    assert not set(train.seeds) & set(dev.seeds)
    with pytest.raises(ValueError, match="split"):
        DrillSource("test", seed=0)


# ------------------------------------------------------------------------------------------------ tokenizer
ROLES = [  # one lookup, written where a student meets it
    "Question: Where in the frame does the white square appear?",
    "A: bottom left\nB: top right\nC: top left\nD: bottom right",
    "<frame 3 at 78.8s>[a small white square at the bottom left; a large red cross at the top right]",
    "##Summary: 16 frames from 00:00 to 01:58. At 01:18 a small white square is at the bottom left.\n##Answer: A",
    "[qwen3_big] Rough Browser: From 01:18 to 01:30 a small white square is at the bottom left.",
]


def _find(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.slow
def test_the_reading_tokenizer_keeps_lookup_words_the_same_in_every_role(m1_cache):
    from transformers import AutoTokenizer

    from m1.config import TinySpec
    from m1.models.tiny import ensure_tiny

    spec = TinySpec(arch="qwen2", hidden_size=32, layers=1, heads=2, kv_heads=1, corpus="reading")
    tok = AutoTokenizer.from_pretrained(ensure_tiny(spec))  # loaded as Qwen2Tokenizer: Qwen's split imposed
    old = AutoTokenizer.from_pretrained(ensure_tiny(spec.model_copy(update={"corpus": "seed_kinds"})))
    for words, roles in ((" white square", [0, 2, 3, 4]), (" bottom left", [1, 2, 3, 4])):
        want = tok(words, add_special_tokens=False)["input_ids"]
        assert len(want) == 2  # one token a word
        for r in roles:
            assert _find(tok(ROLES[r], add_special_tokens=False)["input_ids"], want), (words, ROLES[r])
    # the phrase tokenizer (seed kinds) hides some of them: e.g. an option line merged into one token
    hidden = [(w, r) for w, roles in ((" white square", [0, 2, 3, 4]), (" bottom left", [1, 2, 3, 4])) for r in roles
              if not _find(old(ROLES[r], add_special_tokens=False)["input_ids"],
                           old(w, add_special_tokens=False)["input_ids"])]
    assert hidden, "the phrase tokenizer was expected to merge a lookup word into a phrase somewhere"
    for text in ROLES:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # boilerplate without a lookup word may still be one token (prompts stay short)
    assert len(tok.tokenize("Answer with one option letter (A, B, C, D) - the letter alone, without the option "
                            "text.")) <= 3


# ------------------------------------------------------------------------------------------------ m1 pretrain
def _cfg(tmp_path, **over):
    from m1.pretrain.config import PretrainConfig

    data = {"out_dir": str(tmp_path / "pt"),
            "student": {"arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1,
                        "corpus": "reading", "init_std": 0.02, "seed": 5},
            "steps": 6, "batch_size": 4, "warmup": 2, "mix": {"find": 1, "clock": 1, "grounding": 1},
            "curriculum": [{"start": 0, "frames": 2}, {"start": 4, "frames": 4}],
            "eval": {"every": 3, "drills": 4, "final_drills": 4, "families": ["find", "grounding"]},
            "checkpoint_every": 3}
    data.update(over)
    return PretrainConfig.model_validate(data)


def test_pretrain_config_names_what_is_wrong(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unknown families"):
        _cfg(tmp_path, mix={"lookup": 1})
    with pytest.raises(ValidationError, match="first stage must start at step 0"):
        _cfg(tmp_path, curriculum=[{"start": 5, "frames": 4}])
    assert _cfg(tmp_path).frames_at(3) == 2 and _cfg(tmp_path).frames_at(4) == 4
    staged = _cfg(tmp_path, curriculum=[{"start": 0, "frames": 2, "mix": {"option": 1}}, {"start": 4, "frames": 4},
                                        {"start": 6, "mix": {"find": 1, "text": 1}}])
    assert staged.mix_at(5) == {"option": 1} and staged.mix_at(6) == {"find": 1, "text": 1}
    assert _cfg(tmp_path).mix_at(5) == _cfg(tmp_path).mix
    with pytest.raises(ValidationError, match=r"curriculum\[1\]\.mix: unknown families"):
        _cfg(tmp_path, curriculum=[{"start": 0}, {"start": 2, "mix": {"lookup": 1}}])


@pytest.mark.slow
def test_pretrain_trains_evaluates_and_resumes_exactly(tmp_path, m1_cache):
    """A run stopped after step 3 and resumed ends with the weights and metrics of an uninterrupted run; the base is
    saved with its record."""
    import torch

    from m1.pretrain.train import Pretrainer

    whole = Pretrainer(_cfg(tmp_path / "a"), progress=lambda s: None)
    before = {k: v.clone() for k, v in whole.model.state_dict().items()}
    record = whole.run()
    assert record["steps"] == 6 and set(record["held_out"]) == {"find", "grounding"}
    assert set(record["graded"]) == {"grounding"} and record["cpu_seconds"] > 0
    assert any(not torch.equal(before[k], v) for k, v in whole.model.state_dict().items())
    assert (tmp_path / "a" / "pt" / "base" / "record.json").is_file()
    assert [r["step"] for r in whole.history] == [3, 6]  # the shared step loop logs the evaluations' rows alone

    first = Pretrainer(_cfg(tmp_path / "b"), progress=lambda s: None)
    assert first.run(stop_after=3) is None and first.step == 3
    second = Pretrainer(_cfg(tmp_path / "b"), progress=lambda s: None)
    assert second.step == 3
    second.run()
    for k, v in whole.model.state_dict().items():
        torch.testing.assert_close(second.model.state_dict()[k], v, rtol=0, atol=0)
    rows = lambda p: [json.loads(r) for r in (p / "pt" / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in b] == [3, 6] and [r["loss"] for r in a] == [r["loss"] for r in b]
    # a checkpoint written before a setting existed (here: a stage's `mix`) resumes under its default ...
    state = torch.load(tmp_path / "b" / "pt" / "checkpoint.pt", weights_only=False)
    for stage in state["config"]["curriculum"]:
        del stage["mix"]
    torch.save(state, tmp_path / "b" / "pt" / "checkpoint.pt")
    assert Pretrainer(_cfg(tmp_path / "b"), progress=lambda s: None).step == 6
    # ... while a changed setting is refused
    with pytest.raises(ValueError, match="written by another config"):
        Pretrainer(_cfg(tmp_path / "b", lr=2e-3), progress=lambda s: None)


@pytest.mark.slow
def test_pretrain_resumed_between_rows_logs_the_rows_of_an_uninterrupted_run(tmp_path, m1_cache):
    """A run killed at a checkpoint that falls between two logged rows (checkpoint every 2 steps, a
    row every 3) and resumed logs the same rows as an uninterrupted run: the row after the resume averages the steps
    before the kill too. Only the clocks differ."""
    from m1.pretrain.train import Pretrainer

    cfg = lambda where: _cfg(where, checkpoint_every=2)  # noqa: E731
    Pretrainer(cfg(tmp_path / "a"), progress=lambda s: None).run()
    first = Pretrainer(cfg(tmp_path / "b"), progress=lambda s: None)
    assert first.run(stop_after=4) is None and first.step == 4  # as a kill -9 right after step 4's checkpoint
    second = Pretrainer(cfg(tmp_path / "b"), progress=lambda s: None)
    assert second.step == 4
    second.run()
    clocks = ("cpu_s", "wall_s")
    rows = lambda p: [{k: v for k, v in json.loads(r).items() if k not in clocks}  # noqa: E731
                      for r in (p / "pt" / "metrics.jsonl").read_text().splitlines()]
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in a] == [3, 6] and b == a
