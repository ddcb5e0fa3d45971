"""SFT: the paper's keep rule for teacher plans, example files, and cross-entropy training of tiny agents."""
import json
from pathlib import Path

import pytest
import yaml

from tests.fakes import FakeChat, FakeVision, content, scripted_reply
from m1.config import TeamConfig
from m1.marl.config import SFTConfig, load_sft_config
from m1.marl.reward.rewards import RewardConfig
from m1.marl.sft import build_sft_data, is_revision, read_examples, rotate_options, thin_communicate, write_examples
from m1.marl.sft_examples import SFTExample, plan_unchanged, select_examples
from m1.schema import AgentAnswer, AgentRecord, Decision, Episode, Generation, Question, Turn
from m1.team import topology as topo

AGENTS = ["alpha", "beta"]


def q(i=0, answer="A"):
    return Question(id=f"q{i}", video="v.mp4", text="What colour is the square?", options=["white", "red"],
                    task="mcq", answer=answer)


def episode(answers: dict[str, str], changed: set[str] = frozenset(), error=None, i=0):
    memory = {}
    for a in AGENTS:
        decision = Decision(action="add_tool", tool="Fine Browser") if a in changed else Decision()
        memory[a] = AgentRecord(plan=["Global Sampling", "Rough Browser"], answer=answers.get(a),
                                turns=[Turn(step=1, tool="Global Sampling", key_info="square", output="frames",
                                            decision=decision)])
    gens = [Generation(agent=a, phase=ph, prompt=[{"role": "user", "content": f"{ph} prompt for {a}"}],
                       completion=f"{ph} by {a}") for a in AGENTS for ph in ("plan", "communicate", "answer")]
    return Episode(id=f"e{i}", question=q(i), topology=topo.complete(AGENTS), memory=memory, generations=gens,
                   answers=[AgentAnswer(agent=a, answer=x) for a, x in answers.items()], error=error)


def test_keep_rule_needs_one_right_agent_and_an_unchanged_plan():
    eps = [episode({"alpha": "A", "beta": "B"}, changed={"beta"}, i=0),  # alpha right; beta changed its plan
           episode({"alpha": "B", "beta": "B"}, i=1),  # nobody right: nothing kept
           episode({"alpha": "B", "beta": "A"}, i=2),  # beta right: both unchanged plans kept
           episode({}, error="cannot read video", i=3)]
    assert plan_unchanged(eps[0], "alpha") and not plan_unchanged(eps[0], "beta")
    examples, stats = select_examples(eps, RewardConfig())
    assert [(e.question_id, e.agent, e.phase) for e in examples] == [
        ("q0", "alpha", "plan"), ("q2", "alpha", "plan"), ("q2", "beta", "plan")]
    assert examples[0].completion == "plan by alpha" and examples[0].messages[0]["content"] == "plan prompt for alpha"
    assert stats == {"episodes": 4, "episodes_failed": 1, "episodes_nobody_right": 1, "kept": 3,
                     "dropped_plan_changed": 1}
    # ours: only plans need an unchanged plan; beta's revising decision and its answer are kept
    more, stats = select_examples(eps[:1], RewardConfig(), phases=("plan", "communicate", "answer"))
    assert [(e.agent, e.phase) for e in more] == [("alpha", "plan"), ("alpha", "communicate"), ("alpha", "answer"),
                                                 ("beta", "communicate"), ("beta", "answer")]
    assert stats["dropped_plan_changed"] == 1
    # ours: keep_revised_plans keeps a revised plan only when its own agent answered right
    revised = [eps[0], episode({"alpha": "B", "beta": "A"}, changed={"beta"}, i=4)]
    kept, stats = select_examples(revised, RewardConfig(), keep_revised_plans=True)
    assert [(e.question_id, e.agent) for e in kept] == [("q0", "alpha"), ("q4", "alpha"), ("q4", "beta")]
    assert stats["kept_revised_plans"] == 1 and stats["dropped_plan_changed"] == 1  # beta in q0 answered wrong
    assert [(e.question_id, e.agent) for e in select_examples(revised, RewardConfig())[0]] == [
        ("q0", "alpha"), ("q4", "alpha")]


def fake_teacher(answer_letter):
    def reply(messages):
        text = scripted_reply(messages)
        return text.replace("##Answer: A", f"##Answer: {answer_letter}") if "##Answer" in text else text

    cfg = TeamConfig.model_validate({
        "name": "teacher", "models": {"t": {"interface": "chat", "path": "fake/t"}, "vlm": {"interface": "vision", "path": "x"}},
        "agents": [{"name": "alpha", "model": "t"}, {"name": "beta", "model": "t"}],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 4,
                  "rough_frames": 4}, "limits": {"max_turns": 2}})
    from m1.models.hub import ModelHub
    from m1.team.cpp import Team

    hub = ModelHub(cfg.models)
    hub.register("t", FakeChat("t", reply))
    hub.register("vlm", FakeVision())
    return Team(cfg, hub=hub)


def test_build_sft_data_from_a_teacher_team(tmp_path, video):
    qs = [q(i).model_copy(update={"video": video}) for i in range(3)]
    kept, stats = build_sft_data(fake_teacher("A"), qs, RewardConfig(), rollouts=2)
    assert stats["kept"] == len(kept) == 3 * 2 * 2  # questions x rollouts x agents, plans only
    assert all(e.phase == "plan" and "##tool use" in e.completion for e in kept)
    assert all(e.messages[-1]["role"] == "user" and "white" in content(e.messages) for e in kept)  # options shown
    wrong, stats = build_sft_data(fake_teacher("B"), qs, RewardConfig())
    assert wrong == [] and stats["episodes_nobody_right"] == 3
    path = write_examples(tmp_path / "sft.jsonl", kept)
    assert read_examples(path) == kept
    (tmp_path / "bad.jsonl").write_text('{"agent": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_examples(tmp_path / "bad.jsonl")


def test_rotated_teacher_rollouts_move_the_truth_letter(video):
    """rollout 1 of a two-option question shows the options swapped, so a teacher that always says B is right
    there only, and the examples kept from it show the swapped options"""
    qs = [q(i).model_copy(update={"video": video}) for i in range(3)]
    kept, stats = build_sft_data(fake_teacher("B"), qs, RewardConfig(), rollouts=2, rotate=True)
    assert stats["episodes"] == 6 and stats["episodes_nobody_right"] == 3 and len(kept) == 3 * 2
    assert all("A: red\nB: white" in content(e.messages) for e in kept)
    kept, stats = build_sft_data(fake_teacher("A"), qs, RewardConfig(), rollouts=2, rotate=True)
    assert len(kept) == 3 * 2 and all("A: white\nB: red" in content(e.messages) for e in kept)


STUDENTS = {
    "name": "students",
    "models": {"qa": {"interface": "chat", "device": "cpu",
                      "tiny": {"arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1}},
               "qb": {"interface": "chat", "device": "cpu",
                      "tiny": {"arch": "qwen2", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 2}}},
    "agents": [{"name": "alpha", "model": "qa"}, {"name": "beta", "model": "qb"}],
    "tools": {"enabled": ["Global Sampling", "Rough Browser"]},
}

EXAMPLES = [SFTExample(agent=a, question_id=f"q{i}", phase="plan",
                       messages=[{"role": "user", "content": f"Plan tools for question {i}."}],
                       completion="##key info: the white square\n##tool use: <Global Sampling>, <Rough Browser>")
            for i in range(4) for a in AGENTS]


def sft_cfg(out, **over):
    data = {"team": STUDENTS, "data": {"examples": str(out / "examples.jsonl")},
            "learner": {"finetune": "full", "lr": 1e-2, "micro_batch_size": 4, "max_grad_norm": None},
            "epochs": 3, "batch_size": 4, "out_dir": str(out), "checkpoint": {"every": 3},
            "log": {"progress": False, "backends": []}}
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(data.get(k), dict) else v
    return SFTConfig.model_validate(data)


@pytest.mark.slow
def test_sft_trains_on_completion_tokens_and_lowers_the_loss(tmp_path, m1_cache):
    from m1.marl.sft import SFTTrainer

    tr = SFTTrainer(sft_cfg(tmp_path), examples=EXAMPLES)
    learner = tr.learners.learners["alpha"]
    s = learner.actor.scorer.sft_sample(EXAMPLES[0])
    tok = learner.actor.tokenizer
    assert tok.decode(s.completion_ids) == EXAMPLES[0].completion + "<|im_end|>"  # the target ends the turn
    assert tok.decode(s.prompt_ids).endswith("<|im_start|>assistant\n")  # the prompt is context only
    assert tr.total_steps == 6  # 8 examples / batch 4 x 3 epochs
    rows = tr.train()
    assert [r["step"] for r in rows] == list(range(1, 7))
    for a in AGENTS:
        assert rows[0][f"{a}/samples"] == 4  # assign=all: every student learns every example
        assert rows[-1][f"{a}/loss"] < 0.6 * rows[0][f"{a}/loss"]
        # every example has the same completion: the loss counts exactly its tokens (plus end-of-turn), 4 times
        sample = tr.learners.learners[a].actor.scorer.sft_sample(EXAMPLES[0])
        assert rows[0][f"{a}/tokens"] == 4 * len(sample.completion_ids)
    assert (tmp_path / "checkpoints" / "step-000006" / "agents" / "beta" / "model" / "config.json").is_file()
    resumed = SFTTrainer(sft_cfg(tmp_path), examples=EXAMPLES)
    assert resumed.step == 6 and resumed.train() == []


@pytest.mark.slow
def test_sft_lora_same_name_assignment_moves_only_adapters(tmp_path, m1_cache):
    import torch

    from m1.marl.sft import SFTTrainer

    only_alpha = [e for e in EXAMPLES if e.agent == "alpha"]
    cfg = sft_cfg(tmp_path, learner={"finetune": "lora"}, data={"assign": "same_name"}, batch_size=5,
                  max_steps=1)
    tr = SFTTrainer(cfg, examples=only_alpha + [EXAMPLES[1]])  # one beta example
    policy = tr.learners.learners["alpha"].actor.policy
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    adapter = tr.learners.parameters("alpha")
    rows = tr.train()
    assert (rows[0]["alpha/samples"], rows[0]["beta/samples"]) == (4, 1)  # each learns only its own plans
    params = dict(policy.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in base.items())
    assert any(not torch.equal(params[n].detach(), p) for n, p in adapter.items() if "lora_B" in n)


@pytest.mark.slow
def test_sft_main_and_configs(tmp_path, m1_cache):
    from m1.marl.sft import sft_main

    write_examples(tmp_path / "examples.jsonl", EXAMPLES)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(sft_cfg(tmp_path).model_dump(mode="json")))
    printed = []
    rows = sft_main(path, ["max_steps=1"], progress=printed.append)
    assert len(rows) == 1 and "8 examples" in printed[0]
    ckpt = tmp_path / "checkpoints" / "step-000001" / "agents"
    assert printed[-1].startswith("answer with the trained agents: m1 infer VIDEOS --team")
    assert all(f"path={ckpt / a['name'] / 'model'}" in printed[-1] for a in STUDENTS["agents"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 1
    full = load_sft_config("videochat_m1_full")
    assert full.learner.finetune == "full" and full.learner.learning_rate() == 1e-6
    assert full.teacher_config().models["qwen3_8b"].backend == "openai"
    assert load_sft_config("videochat_m1_lora").learner.lora.r == 8
    assert load_sft_config("mini").team_config().name == "mini"
    with pytest.raises(ValueError, match="teacher"):
        SFTConfig.model_validate({"team": STUDENTS, "data": {"questions": "q.jsonl"}})


def test_plan_filter_all_keeps_every_plan_and_the_rule_for_the_rest():
    """The weak-plan start: every plan is learnt whatever the outcome; answers still need a right agent."""
    eps = [episode({"alpha": "A", "beta": "B"}, changed={"beta"}, i=0), episode({"alpha": "B", "beta": "B"}, i=1),
           episode({}, error="cannot read video", i=2)]
    kept, stats = select_examples(eps, RewardConfig(), phases=("plan", "answer"), plan_filter="all")
    assert [(e.question_id, e.agent, e.phase) for e in kept] == [
        ("q0", "alpha", "plan"), ("q0", "alpha", "answer"), ("q0", "beta", "plan"), ("q0", "beta", "answer"),
        ("q1", "alpha", "plan"), ("q1", "beta", "plan")]
    assert stats["episodes_nobody_right"] == 1 and stats["episodes_failed"] == 1 and stats["kept"] == 6


def test_uniform_teacher_plans_any_valid_pair_and_keeps_its_key_info():
    from m1.agents.prompts import plan_messages
    from m1.config import ModelSpec
    from m1.synth.teacher import BROWSE, SELECT, TeacherChatModel, key_plan

    rules = TeacherChatModel(ModelSpec(interface="chat", backend="synth", seed=1))
    uniform = TeacherChatModel(ModelSpec(interface="chat", backend="synth", seed=1, plans="uniform"))
    tools = list(SELECT + BROWSE)
    seen, same = set(), 0
    for i in range(200):
        text = f"How many times does a red square appear in part {i}?"
        question = Question(id=str(i), video="v.mp4", text=text, options=["1", "2"], task="mcq")
        msgs = plan_messages(question, tools)
        assert rules.reply(msgs).endswith("<Image Retrieval>, <Fine Browser>")
        plan = uniform.reply(msgs)
        key, rule_tools = key_plan(text)[:2]
        assert plan.startswith(f"##key info: {key}\n##tool use: ")
        pair = tuple(t.strip("<> ") for t in plan.split("##tool use: ")[1].split(", "))
        assert pair[0] in SELECT and pair[1] in BROWSE
        seen.add(pair)
        same += list(pair) == rule_tools
        assert uniform.reply(msgs) == plan  # deterministic per prompt
    assert len(seen) == 16 and 2 <= same <= 30  # about 1 in 16 is the rules' own pair


@pytest.mark.slow
def test_sft_names_a_lost_ray_node_and_where_the_rerun_resumes(tmp_path, m1_cache, monkeypatch):
    """A learner node lost mid-SFT gives the same one-line error as GRPO does (node, ranks, resume step), not Ray's
    bare actor error; any other error passes through unchanged."""
    import m1.marl.actor.groups as groups
    from m1.marl.actor.distributed import DistributedError
    from m1.marl.sft import SFTTrainer

    class ActorDied(RuntimeError):
        pass

    monkeypatch.setattr(groups, "lost_ranks", lambda learners, exc: (
        "Ray node n2 (address 10.0.0.2) died: it held agent beta rank 1 of 2" if isinstance(exc, ActorDied) else None))
    tr = SFTTrainer(sft_cfg(tmp_path), examples=EXAMPLES)
    update = tr.learners.update
    failures = {4: ActorDied("actor died"), 2: ValueError("a learner's own error")}

    def update_failing(samples, lr, family):
        if tr.step + 1 in failures:
            raise failures.pop(tr.step + 1)
        return update(samples, lr, family)

    tr.learners.update = update_failing
    with pytest.raises(ValueError, match="a learner's own error"):
        tr.train()
    assert tr.step == 1 and tr.checkpointed == 0
    with pytest.raises(DistributedError) as err:
        tr.train()
    assert str(err.value) == ("Ray node n2 (address 10.0.0.2) died: it held agent beta rank 1 of 2, during SFT step 4 "
                              "of 6; the run stopped. Start the node again (or give the run other GPUs) and rerun the "
                              "same command: it resumes from the checkpoint of step 3")
    assert isinstance(err.value.__cause__, ActorDied)


def test_rotate_options_moves_the_truth_letter_with_the_options():
    """data.rotate_options: rollout k of a teacher sees the options rotated by k places, the truth letter moved with
    them (the synth browser follows: tests/synth/test_synth.py)."""
    q = Question(id="q", video="v.mp4", text="Where is the square?", options=["top", "left", "right", "bottom"],
                 task="mcq", answer="B")
    assert [(r.options, r.answer) for r in (rotate_options(q, k) for k in range(4))] == [
        (["top", "left", "right", "bottom"], "B"), (["bottom", "top", "left", "right"], "C"),
        (["right", "bottom", "top", "left"], "D"), (["left", "right", "bottom", "top"], "A")]
    assert rotate_options(q.model_copy(update={"answer": "left"}), 1).answer == "C"  # truth given as option text
    open_q = q.model_copy(update={"task": "open", "options": [], "answer": "red"})
    assert rotate_options(open_q, 3) is open_q
    with pytest.raises(ValueError, match="'purple' is not one of the option letters"):
        rotate_options(q.model_copy(update={"answer": "purple"}), 1)


@pytest.mark.parametrize("command", ["sft", "train"])
def test_training_commands_run_on_the_threads_asked_and_give_them_back(monkeypatch, command):
    """`m1 sft` / `m1 train` run on one torch thread unless told (what an experiment gives each seed), on torch's
    own count with --threads 0, and the process gets its own count back afterwards."""
    import torch
    from typer.testing import CliRunner

    import m1.marl.launch as launch
    import m1.marl.sft as sft_module
    from m1.cli import app

    seen = []
    fake = lambda config, sets, progress: seen.append(torch.get_num_threads())  # noqa: E731
    monkeypatch.setattr(sft_module if command == "sft" else launch, "sft_main" if command == "sft" else "train_main",
                        fake)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for args in ([], ["--threads", "0"], ["--threads", "2"]):
            result = CliRunner().invoke(app, [command, "--config", "mini", *args])
            assert result.exit_code == 0, result.output
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 2]


def test_kept_revisions_escape_the_communicate_budget_and_continues_do_not():
    """communicate_per_episode thins the majority continue() examples; with communicate_revisions: keep, an example
    that adds a tool stays whatever its place, and the budget counts the continue() examples only."""
    cont = "##tool call: continue()"
    add = "##tool call: add tool <Image Retrieval>\n##key info: the red square near the end"
    rows = [("q1", "a", cont), ("q1", "a", add), ("q1", "a", cont), ("q1", "b", add), ("q1", "b", cont),
            ("q2", "a", cont)]
    examples = [SFTExample(agent=a, question_id=q, phase="communicate", messages=[], completion=c) for q, a, c in rows]
    examples.append(SFTExample(agent="a", question_id="q1", phase="answer", messages=[], completion="##Answer: B"))
    assert [is_revision(e) for e in examples] == [False, True, False, True, False, False, False]

    def kept(keep):
        return [(e.question_id, e.agent, is_revision(e)) for e in thin_communicate(examples, 1, keep)
                if e.phase == "communicate"]

    assert kept(False) == [("q1", "a", False), ("q1", "b", True), ("q2", "a", False)]  # the first per agent only
    assert kept(True) == [("q1", "a", False), ("q1", "a", True), ("q1", "b", True), ("q1", "b", False),
                          ("q2", "a", False)]
    assert sum(e.phase == "answer" for e in thin_communicate(examples, 0, True)) == 1  # other phases untouched


def test_spread_draws_the_communicate_budget_from_every_round():
    """communicate_pick: spread keeps communicate_per_episode examples per agent and question drawn from all its
    rounds, not the first ones (where a rule teacher seldom revises); the draw is seeded, and takes every
    round over many questions."""
    examples = [SFTExample(agent=a, question_id=f"q{n}", phase="communicate", messages=[],
                           completion=f"##tool call: continue()\n##round: {r}")
                for n in range(60) for a in ("a", "b") for r in (1, 2, 3)]
    first = thin_communicate(examples, 1)
    spread = thin_communicate(examples, 1, spread=True)
    assert len(first) == len(spread) == 120
    assert {e.completion[-1] for e in first} == {"1"}
    rounds = [int(e.completion[-1]) for e in spread]
    assert all(rounds.count(r) >= 25 for r in (1, 2, 3)), rounds  # about 40 of each
    assert thin_communicate(examples, 1, spread=True) == spread  # seeded: the same on every build
    assert len(thin_communicate(examples, 2, spread=True)) == 240


def missing_video_run(tmp_path, video, answer_letter, present=2, missing=3):
    """An SFT config whose teacher (`fake_teacher`) is asked `present` questions on `video` and `missing` on videos
    that are not there, and the teacher's hub."""
    qs = [q(i).model_copy(update={"video": video}) for i in range(present)]
    gone = [str(tmp_path / f"gone_{i * 2 // missing}.mp4") for i in range(missing)]  # two videos (one for one)
    qs += [q(present + i).model_copy(update={"video": v}) for i, v in enumerate(gone)]
    (tmp_path / "qs.jsonl").write_text("".join(x.model_dump_json() + "\n" for x in qs))
    teacher = fake_teacher(answer_letter)
    cfg = sft_cfg(tmp_path, data={"questions": str(tmp_path / "qs.jsonl"),
                                  "teacher": teacher.cfg.model_dump(mode="json")})
    return cfg, teacher.hub


def test_sft_data_names_the_questions_whose_videos_are_missing(tmp_path, video, caplog):
    """Questions whose video is missing are left out with a warning naming them (the teacher never runs on them);
    the file built without them is built again once they are back."""
    from m1.marl.sft import prepare_examples

    cfg, hub = missing_video_run(tmp_path, video, "A")
    with caplog.at_level("WARNING", logger="m1.marl.sft"):
        examples, stats = prepare_examples(cfg, hub)
    said = [r.getMessage() for r in caplog.records if "videos are missing" in r.getMessage()]
    assert said == [f"SFT data: 3 of 5 questions left out, their videos are missing: q2, q3, q4 (2 videos: "
                    f"{tmp_path / 'gone_0.mp4'}, {tmp_path / 'gone_1.mp4'})"]
    assert stats["episodes"] == 2 and stats["episodes_failed"] == 0 and len(examples) == 2 * 2  # present x agents
    assert stats["videos_missing"] == {str(tmp_path / "gone_0.mp4"): ["q2", "q3"], str(tmp_path / "gone_1.mp4"): ["q4"]}
    caplog.clear()
    with caplog.at_level("WARNING", logger="m1.marl.sft"):  # read back: still named
        assert prepare_examples(cfg, hub)[0] == examples
    assert any("built without 3 questions whose video is missing: q2, q3, q4" in r.getMessage()
               for r in caplog.records)
    (tmp_path / "gone_1.mp4").write_bytes(Path(video).read_bytes())  # one is back: built again, with it
    examples, stats = prepare_examples(cfg, hub)
    assert stats["episodes"] == 3 and stats["videos_missing"] == {str(tmp_path / "gone_0.mp4"): ["q2", "q3"]}


def test_sft_with_no_examples_says_which_videos_are_missing(tmp_path, video):
    """When no example is left the error says why: every video missing (the teacher never runs), or
    some missing and the teacher's other episodes all wrong."""
    from m1.marl.sft import SFTTrainer

    cfg, hub = missing_video_run(tmp_path, video, "A", present=0, missing=7)
    with pytest.raises(ValueError) as err:
        SFTTrainer(cfg, teacher_hub=hub)
    assert str(err.value) == (
        f"SFT: no examples were kept: the videos of all 7 questions are missing: q0, q1, q2, q3, q4, ... (7 in all) "
        f"(2 videos: {tmp_path / 'gone_0.mp4'}, {tmp_path / 'gone_1.mp4'}); check data.questions "
        f"({tmp_path / 'qs.jsonl'}) and data.video_dir (None)")
    assert not (tmp_path / "examples.jsonl").exists()
    cfg, hub = missing_video_run(tmp_path, video, "B", present=1, missing=1)  # the teacher is wrong on the rest
    with pytest.raises(ValueError) as err:
        SFTTrainer(cfg, teacher_hub=hub)
    assert str(err.value).startswith(
        f"SFT: no examples were kept; nothing to train on (left out 1 question whose video is missing: q1 "
        f"(1 video: {tmp_path / 'gone_0.mp4'}); the teacher's episodes: episodes 1, episodes_failed 0, "
        f"episodes_nobody_right 1, kept 0")
