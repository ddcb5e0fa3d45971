"""The seed systems' engine: one vision-language policy in a multi-turn tool loop (Weaver, VideoZoomer, SAGE).

A team of one agent of `kind: weaver | zoomer | sage` runs here instead of the CPP engine, behind the same
entry points (`m1.team.engines_registry.make_team`, `m1 infer`, `m1 eval`, `run_questions`) and into the same `Episode`,
so results lines, traces and metrics are unchanged. Per turn, every episode in flight gets one batched generate call
of the policy model (one per temperature where `run(temperatures=)` sets episodes apart), and the vision
requests of all tool calls one batched call per vision model.

    turn 0    user: glance (uniform frames, each after its time) + question
    turn k    policy reply -> parsed (the kind's parser, m1/kinds/<kind>.py) -> tool call(s) | answer
              tool call -> observation text + the frames it returned, as the next user turn
    last turn the user turn says no tools are left; a reply without an answer leaves the question unanswered

Tool observations are context, never generation targets: only the policy's replies are Generations. A reply the
parser cannot read is a format failure (parse_ok False) and, before the last turn, the policy is told why and
tries again. Frames used = the distinct frames the policy saw plus those tool models read (CLIP scoring, as in
the CPP engine, is not counted); `Episode.frame_counts` splits them.
"""
from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

from m1.config import TeamConfig
from m1.kinds import prompts
from m1.kinds.settings import settings_for
from m1.kinds.parsers import SeedReply, ToolCall
from m1.kinds.tools import Context, Observation, Pending, SeedTools
from m1.models.base import ChatModel, ChatRequest, Completion, ModelError, SamplingParams, VisionRequest, text_only
from m1.models.hub import ModelHub
from m1.registry import is_seed, seed_kind, seed_kind_names
from m1.schema import AgentAnswer, AgentRecord, Episode, Generation, Question, Topology, Turn
from m1.team import budget
from m1.team.engine import TeamEngine
from m1.text import format_span, parse_span
from m1.video import VideoError, VideoPool, VideoReader, uniform_indices


@dataclass
class _Run:
    question: Question
    topology: Topology
    video: VideoReader | None = None  # None: the video could not be opened (`error` says why)
    ctx: Context | None = None
    messages: list[dict] = field(default_factory=list)
    image_frames: list[int] = field(default_factory=list)  # the frame of each image part, in order
    policy_frames: set[int] = field(default_factory=set)
    tool_frames: set[int] = field(default_factory=set)
    turns: list[Turn] = field(default_factory=list)
    tools_used: list[str] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    done: bool = False
    answer: str | None = None
    reason: str = ""
    parse_ok: bool = False
    error: str | None = None
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    temperatures: dict[str, float] = field(default_factory=dict)  # `run(temperatures=)`: the agent's, over its own

    @property
    def reader(self) -> VideoReader:
        """The open video: every turn runs on episodes that opened theirs."""
        if self.video is None:
            raise self._unopened()
        return self.video

    @property
    def context(self) -> Context:
        """What the episode's tools work on, set once its video opened."""
        if self.ctx is None:
            raise self._unopened()
        return self.ctx

    def _unopened(self) -> RuntimeError:
        return RuntimeError(f"episode {self.question.id}: its video was never opened ({self.error})")


class SingleAgentTeam(TeamEngine):
    """The engine of a seed-kind agent (weaver, zoomer, sage, or one registered elsewhere); a Team as
    m1/contracts.py describes it, like m1.team.cpp.Team."""

    def __init__(self, cfg: TeamConfig, hub: ModelHub | None = None, pool: VideoPool | None = None):
        if len(cfg.agents) != 1 or not is_seed(cfg.agents[0].kind):
            raise ValueError(f"team {cfg.name!r}: SingleAgentTeam runs one agent of a seed kind "
                             f"({', '.join(seed_kind_names())})")
        super().__init__(cfg, hub, pool)
        self.agent = cfg.agents[0]
        self.kind = self.agent.kind
        self.spec = seed_kind(self.kind)  # its prompts, parser and tools (m1/kinds/<kind>.py)
        self.settings = settings_for(self.kind, cfg.seed_system)
        self.order = [self.agent.name]
        self.tools = SeedTools(self.settings, cfg.tools, self._clip)
        self.system = self.spec.system(self.settings)

    # ------------------------------------------------------------------ entry point
    def _draw_topology(self, rng: random.Random) -> Topology:
        """A team of one: its only agent, no edges."""
        return Topology(agents=list(self.order), active=list(self.order), edges=[])

    def _failed_episode(self, question: Question, topology: Topology, error: str) -> Episode:
        return self._finish(_Run(question=question, topology=topology, error=error))

    def run_batch(self, questions: list[Question], topologies: list[Topology],
                  temperatures: list[dict[str, float]] | None = None) -> list[Episode]:
        t0 = time.perf_counter()
        runs = [self._start(q, t) for q, t in zip(questions, topologies)]
        for r, temps in zip(runs, temperatures or []):
            r.temperatures = dict(temps)
        last = self.settings.max_turns - 1
        for turn in range(self.settings.max_turns):
            live = [r for r in runs if not r.done and r.error is None]
            if not live:
                break
            if turn == last:
                for r in live:
                    self._append_text(r, self.spec.last_turn)
            self._policy_turn(live, turn, final=turn == last)
        wall = time.perf_counter() - t0
        for r in runs:
            r.timings["batch_wall"], r.timings["batch_size"] = wall, float(len(runs))
        return [self._finish(r) for r in runs]

    # ------------------------------------------------------------------ steps
    def _within_budget(self, runs: list[_Run], model, images: bool) -> list[_Run]:
        """The runs whose chat so far fits limits.max_prompt_tokens (m1/team/budget.py). A multi-turn chat has nothing
        to trim (its observations are the history the policy acts on): over budget is a PromptBudgetError, or with
        `over_budget: drop` the end of that episode. Chats with images are counted where their image tokens are
        known (the learner); here only text chats are."""
        lim = self.cfg.limits
        if lim.max_prompt_tokens is None or images:
            return runs
        count = budget.token_counter(model)
        kept = []
        for r in runs:
            n = count(text_only(r.messages))
            if n <= lim.max_prompt_tokens:
                kept.append(r)
                continue
            if self.over_budget_rows:
                r.error = "prompt too long: " + budget.over_budget_message(
                    self.agent.name, f"turn {len(r.generations)}", r.question.id, n, lim.max_prompt_tokens, False,
                    advice="shorten the question, or raise limits.max_prompt_tokens")
                continue
            why = budget.over_budget_message(self.agent.name, f"turn {len(r.generations)}", r.question.id, n,
                                             lim.max_prompt_tokens, False)
            if lim.over_budget != "drop":
                raise budget.PromptBudgetError(why)
            r.error = f"dropped: {why}"
        return kept

    def _start(self, q: Question, t: Topology) -> _Run:
        r = _Run(question=q, topology=t)
        t0 = time.perf_counter()
        try:
            r.video = self.pool.open(q.video)
            r.video.check_frames()
            info = r.video.info
            idx = uniform_indices(info, self.settings.glance_frames)
            r.ctx = Context(question=q, video=r.video, span=(0.0, info.duration))
            r.messages = [{"role": "system", "content": self.system},
                          {"role": "user", "content": prompts.first_turn(self.kind, q, info.duration, idx,
                                                                         r.video.timestamps(idx))}]
            r.image_frames = list(idx)
            r.policy_frames.update(idx)
        except VideoError as exc:
            r.error = str(exc)
        except ValueError as exc:  # e.g. a question whose task no prompt knows
            r.error = f"{q.id}: {exc}"
        r.timings["open_video"] = time.perf_counter() - t0
        return r

    def _caption(self, runs: list[_Run], captioner: str) -> None:
        """Describe every frame of the runs' chats that has no description yet, in one call of the captioner, and
        put each description on its image part (contents are replaced, never mutated: earlier snapshots keep theirs).
        Done whatever the policy, so a teacher's recorded prompts read as its text student's."""
        todo = []  # (run, message index, part index, frame)
        for r in runs:
            for i, m in enumerate(r.messages):
                if isinstance(m.get("content"), list):
                    todo += [(r, i, j, p["frame"]) for j, p in enumerate(m["content"])
                             if isinstance(p, dict) and p.get("type") == "image" and "caption" not in p]
        if not todo:
            return
        requests, slots = [], []
        for r in runs:
            mine = [t for t in todo if t[0] is r]
            if not mine:
                continue
            video = r.reader
            t0, d0 = time.perf_counter(), video.decode_seconds
            frames = video.frames([t[3] for t in mine])
            times = video.timestamps([t[3] for t in mine])
            requests += [VisionRequest(frames[k:k + 1], [times[k]], prompts.CAPTION_PROMPT) for k in range(len(mine))]
            slots += mine
            r.timings["decode"] += video.decode_seconds - d0
            r.timings["caption"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens=self.settings.caption_tokens, temperature=0.0, logprobs=False)
        outs = self.hub.vision(captioner).describe(requests, params)
        dt = (time.perf_counter() - t0) / len(slots)
        for (r, i, j, _), out in zip(slots, outs):
            content = list(r.messages[i]["content"])
            content[j] = {**content[j], "caption": prompts.caption_text(out.text)}
            r.messages[i] = {**r.messages[i], "content": content}
            r.timings["caption"] += dt

    def _policy_turn(self, runs: list[_Run], turn: int, final: bool) -> None:
        """One reply of the policy in every run: one generate call per temperature (an episode's own temperature,
        `run(temperatures=)`, wins over the agent's), then the tool calls of all replies together."""
        if self.settings.captioner is not None:
            self._caption(runs, self.settings.captioner)
        model = self._policy()
        own = self.agent.temperature if self.agent.temperature is not None else self.cfg.sampling.temperature
        groups: dict[float, list[_Run]] = defaultdict(list)
        for r in runs:
            groups[r.temperatures.get(self.agent.name, own)].append(r)
        pending: list[tuple[_Run, SeedReply]] = []
        for temp, group in groups.items():
            pending += self._replies(model, group, temp, turn, final)
        if pending:
            self._run_tools(pending, turn)

    def _policy(self) -> ChatModel:
        """The policy's model: a chat model, or a vision-language model that also writes chat replies (hf
        Qwen2-VL / Qwen2.5-VL, fed the frames as images)."""
        key = self.agent.model
        if self.cfg.models[key].interface != "vision":
            return self.hub.chat(key)
        model = self.hub.vision(key)
        if not isinstance(model, ChatModel):
            raise ModelError(f"model {key!r} (interface vision) describes frames but writes no chat replies, so it cannot "
                             f"be the policy of agent {self.agent.name!r} ({self.kind})")
        return model

    def _replies(self, model: ChatModel, runs: list[_Run], temp: float, turn: int,
                 final: bool) -> list[tuple[_Run, SeedReply]]:
        """One generate call for `runs` at `temp`: each reply recorded as a Generation and answered or parsed; returns
        the runs whose reply calls tools, with that reply."""
        images = getattr(model, "accepts_images", False)
        self._calls += 1
        params = SamplingParams(max_new_tokens=self.settings.reply_tokens, temperature=temp,
                                top_p=self.cfg.sampling.top_p, seed=self._seed + self._calls)
        runs = self._within_budget(runs, model, images)
        if not runs:
            return []
        requests = []
        for r in runs:
            video = r.reader
            d0 = video.decode_seconds
            if images:
                requests.append(ChatRequest(_copy(r.messages), images=list(video.frames(r.image_frames))))
            else:
                requests.append(ChatRequest(text_only(r.messages)))
            r.timings["decode"] += video.decode_seconds - d0
        t0 = time.perf_counter()
        outs = model.generate(requests, params)
        dt = (time.perf_counter() - t0) / max(1, len(runs))
        pending = []
        for r, out in zip(runs, outs):
            r.timings["llm"] += dt
            reply = self.spec.parse(out.text, r.question, self.settings.tools)
            phase = "act" if reply.calls and not final else "answer"
            r.generations.append(Generation(
                agent=self.agent.name, phase=phase, step=turn, prompt=_copy(r.messages), completion=out.text,
                prompt_ids=out.prompt_ids, completion_ids=out.completion_ids, logprobs=out.logprobs,
                parse_ok=reply.ok, parse_error=reply.error, weight_version=out.meta.get("weight_version"),
                evidence=list(out.evidence) or None))
            r.messages.append({"role": "assistant", "content": out.text})
            if reply.calls and not final:
                pending.append((r, reply))
            elif reply.answer is not None or final:
                r.done, r.answer, r.reason, r.parse_ok = True, reply.answer, reply.reason, reply.ok
            else:  # unreadable, and turns are left: say why, let it try again
                r.messages.append({"role": "user", "content": [{"type": "text", "text": (
                    f"Your reply could not be read ({reply.error}). Follow the format in the instructions.")}]})
        return pending

    def _run_tools(self, pending: list[tuple[_Run, SeedReply]], turn: int) -> None:
        """Prepare every call, send each vision model its requests in one call, then finish and append."""
        prepared: list[tuple[_Run, list[tuple[ToolCall, Pending]]]] = []
        by_model: dict[str, list[tuple[int, int, int]]] = defaultdict(list)  # key -> (run k, call j, request m)
        for k, (r, reply) in enumerate(pending):
            t0, d0 = time.perf_counter(), r.reader.decode_seconds
            items = []
            for j, call in enumerate(reply.calls):
                p = self.tools.prepare(r.context, call.name, call.args)
                items.append((call, p))
                for m, (key, _req) in enumerate(p.requests):
                    by_model[key].append((k, j, m))
            prepared.append((r, items))
            r.timings["tools"] += time.perf_counter() - t0
            r.timings["decode"] += r.reader.decode_seconds - d0
        replies: dict[tuple[int, int, int], Completion] = {}
        for key, slots in by_model.items():
            t0 = time.perf_counter()
            reqs = [prepared[k][1][j][1].requests[m][1] for k, j, m in slots]
            params = SamplingParams(max_new_tokens=max(self.cfg.tools.grounding_tokens, self.cfg.tools.space_tokens,
                                                       self.cfg.tools.fine_tokens, self.cfg.tools.rough_tokens),
                                    temperature=0.0, logprobs=False)
            outs = self.hub.vision(key).describe(reqs, params)
            dt = (time.perf_counter() - t0) / max(1, len(slots))
            for slot, out in zip(slots, outs):
                replies[slot] = out
                prepared[slot[0]][0].timings["vision"] += dt
        for k, (r, items) in enumerate(prepared):
            parts: list[dict] = []
            for j, (call, p) in enumerate(items):
                t0, d0 = time.perf_counter(), r.reader.decode_seconds
                try:
                    obs = p.finish([replies[(k, j, m)] for m in range(len(p.requests))])
                except (VideoError, ValueError) as exc:
                    obs = Observation(call.name, call.args, "", error=f"{call.name}: {exc}")
                r.timings["tools"] += time.perf_counter() - t0
                parts += self._observe(r, obs, turn)
                r.timings["decode"] += r.reader.decode_seconds - d0
            r.messages.append({"role": "user", "content": parts})

    def _observe(self, r: _Run, obs: Observation, turn: int) -> list[dict]:
        """Record the call in memory and render its observation (text line, then its frames)."""
        r.tools_used.append(obs.tool)
        r.tool_frames.update(obs.tool_frames)
        times = r.reader.timestamps(obs.indices) if obs.indices else []
        r.turns.append(Turn(step=len(r.turns) + 1, tool=obs.tool, key_info=json.dumps(obs.args, ensure_ascii=False,
                                                                                      default=str)[:500],
                            output=obs.text, timestamps=times, answer=obs.answer, span=obs.span, error=obs.error))
        head = f"[{obs.tool}] " + (f"error: {obs.error}" if obs.error else obs.text)
        parts = [{"type": "text", "text": head}]
        if obs.indices:
            parts += prompts.frame_parts(obs.indices, times, start=len(r.image_frames))
            r.image_frames += list(obs.indices)
            r.policy_frames.update(obs.indices)
        return parts

    # ------------------------------------------------------------------ helpers
    def _append_text(self, r: _Run, text: str) -> None:
        last = r.messages[-1]
        if last["role"] == "user" and isinstance(last["content"], list):
            last["content"] = list(last["content"]) + [{"type": "text", "text": "\n" + text}]
        else:
            r.messages.append({"role": "user", "content": [{"type": "text", "text": text}]})

    def _finish(self, r: _Run) -> Episode:
        name = self.agent.name
        if r.error is None and r.video is not None and r.video.changed is not None:
            # an answer never stands on frames of two files
            r.error, r.answer, r.reason = f"cannot read video {r.video.path}: {r.video.changed}", None, ""
        answers = []
        if r.error is None:
            answers = [AgentAnswer(agent=name, answer=r.answer or "", reason=r.reason, parse_ok=r.parse_ok)]
        memory = {name: AgentRecord(plan=list(r.tools_used), key_info="", turns=r.turns, answer=r.answer,
                                    reason=r.reason or None)}
        if r.question.task == "grounding" and r.answer is not None:
            span = parse_span(r.answer)
            r.answer = format_span(span) if span else r.answer
        counts = {"policy": len(r.policy_frames), "tools": len(r.tool_frames),
                  "turns": len(r.generations), "tool_calls": len(r.turns)} if r.error is None else {}
        return Episode(id=r.question.id, question=r.question, topology=r.topology, memory=memory,
                       generations=r.generations, answers=answers, final_answer=r.answer, final_reason=r.reason,
                       aggregation=f"single ({self.kind})", frames_used=len(r.policy_frames | r.tool_frames),
                       frame_counts=counts, timings=dict(r.timings), error=r.error)


def _copy(messages: list[dict]) -> list[dict]:
    """A snapshot of the chat (contents are replaced, never mutated in place, so a shallow copy per message does)."""
    return [dict(m) for m in messages]
