"""The episode engine of collaborative policy planning (CPP).

A batch of episodes advances phase by phase — plan, then up to `max_turns` rounds of
execute + communicate, then answer and aggregate. In every phase the requests of all agents of
all episodes in flight are gathered and each model gets **one batched call** (per distinct
sampling temperature). Browsers are batched the same way per vision model. Frames come from one
shared VideoPool, CLIP embeddings from one ClipIndex per CLIP model, so nothing is decoded or
embedded twice. An agent whose model is a served M1 team (`interface: team`, m1/team/member.py) only answers.

Errors: a bad video ends that episode with `error` set; a failing tool becomes an error turn in
memory; an unreadable reply is a format failure with a fallback. Every prompt fits `limits.max_prompt_tokens`
(m1/team/budget.py): the peers' notes are trimmed oldest first, and a prompt that still does not fit is a
PromptBudgetError, or with `limits.over_budget: drop` ends its episode with `error` set; so does a prompt over the room
a model's context leaves, budget or not. When answering (`over_budget_rows`: m1 infer, eval, serve) either ends only
that question's episode, as its error row. A model that cannot be called (ModelError) stops the run: retrying belongs
to the backend, and a resumed run picks up there. One exception when answering (`server_error_rows`: m1 infer, eval):
a served model that stopped answering ends the batch in flight as error rows and the run goes on, until a second
batch in a row fails so.
"""
from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import product
from typing import Callable

from m1.agents.agent import PolicyAgent
from m1.config import TeamConfig
from m1.memory import SharedMemory
from m1.models.base import ChatRequest, SamplingParams, VisionRequest
from m1.models.hub import ModelHub
from m1.registry import is_seed
from m1.schema import AgentAnswer, Decision, Episode, Generation, Phase, Question, Topology, Turn
from m1.team import aggregate, budget, topology as topo
from m1.team.engine import TeamEngine
from m1.team.member import ServedMembers
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS, TOOL_NAMES, TOOLS, browse
from m1.tools.base import Focus, ToolContext, ToolError
from m1.tools.select import SELECT, global_focus
from m1.video import VideoError, VideoPool, VideoReader


@dataclass
class _AgentState:
    queue: list[str] = field(default_factory=list)  # remaining plan
    key_info: str = ""
    focus: Focus | None = None
    tool_calls: int = 0
    step: int = 0
    acted: bool = False  # executed a tool this turn
    answer_gen: Generation | None = None


@dataclass
class _Episode:
    question: Question
    topology: Topology
    memory: SharedMemory
    agents: dict[str, _AgentState]
    video: VideoReader | None = None  # None: the video could not be opened (`error` says why)
    generations: list[Generation] = field(default_factory=list)
    answers: list[AgentAnswer] = field(default_factory=list)
    frames: set[int] = field(default_factory=set)
    final: str | None = None
    reason: str = ""
    aggregation: str = ""
    error: str | None = None
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # agent -> the temperature it decodes with in this episode, over its own (per-agent credit: teammates at 0)
    temperatures: dict[str, float] = field(default_factory=dict)
    usage: dict[str, dict] = field(default_factory=dict)  # Episode.usage

    @property
    def reader(self) -> VideoReader:
        """The open video: every phase runs on episodes that opened theirs."""
        if self.video is None:
            raise RuntimeError(f"episode {self.question.id}: its video was never opened ({self.error})")
        return self.video


@dataclass
class _Call:
    """One pending chat request of one agent in one episode."""

    ep: _Episode
    agent: PolicyAgent
    phase: Phase
    messages: list[dict]
    max_tokens: int
    step: int = 0
    trimmed: int = 0  # entries of the peers' notes left out to fit the prompt budget


class Team(TeamEngine):
    """A team of policy agents over shared models, tools and video pool."""

    def __init__(self, cfg: TeamConfig, hub: ModelHub | None = None, pool: VideoPool | None = None):
        seeded = [a.name for a in cfg.agents if is_seed(a.kind)]
        if seeded:
            raise ValueError(f"team {cfg.name!r}: agent {seeded[0]!r} is a seed-system kind, which the CPP engine does "
                             f"not run; build the team with m1.team.engines_registry.make_team")
        super().__init__(cfg, hub, pool)
        self.agents = [PolicyAgent(a, cfg.tools.enabled) for a in cfg.agents]
        self.served = ServedMembers(cfg, self.hub)  # agents that are whole served teams: they only answer
        self.policies = [a for a in self.agents if a.name not in self.served.names]  # the agents that plan here
        self.by_name = {a.name: a for a in self.agents}
        self.order = [a.name for a in self.agents]
        self._counters: dict[str, Callable[[list[dict]], int]] = {}
        self._rooms: dict[tuple[str, int], int | None] = {}

    # ------------------------------------------------------------------ entry point
    def _draw_topology(self, rng: random.Random) -> Topology:
        return topo.sample(self.order, self.cfg.topology, rng)

    def _failed_episode(self, question: Question, topology: Topology, error: str) -> Episode:
        return self._finish(_Episode(question=question, topology=topology, memory=SharedMemory(self.order), agents={},
                                     error=error))

    def run_batch(self, questions: list[Question], topologies: list[Topology],
                  temperatures: list[dict[str, float]] | None = None) -> list[Episode]:
        t0 = time.perf_counter()
        eps = [self._start(q, t) for q, t in zip(questions, topologies)]
        for ep, temps in zip(eps, temperatures or []):
            ep.temperatures = dict(temps)
        live = [e for e in eps if e.error is None]
        if live:
            self._timed(live, "plan", self._plan_phase)
            for turn in range(self.cfg.limits.max_turns):
                live = [e for e in live if e.error is None]  # an episode dropped over the prompt budget stops
                acted = self._timed(live, "execute", self._execute_phase)
                if not acted:
                    break
                if turn + 1 < self.cfg.limits.max_turns:
                    self._timed(live, "communicate", self._communicate_phase)
            live = [e for e in live if e.error is None]
            self._timed(live, "answer", self._answer_phase)
            live = [e for e in live if e.error is None]
            self._timed(live, "aggregate", self._aggregate_phase)
        wall = time.perf_counter() - t0
        for e in eps:
            e.timings["batch_wall"], e.timings["batch_size"] = wall, float(len(eps))
        return [self._finish(e) for e in eps]

    # ------------------------------------------------------------------ phases
    def _start(self, q: Question, t: Topology) -> _Episode:
        ep = _Episode(question=q, topology=t, memory=SharedMemory(self.order),
                      agents={a: _AgentState() for a in self.order})
        t0 = time.perf_counter()
        try:
            ep.video = self.pool.open(q.video)
            ep.video.check_frames()
        except VideoError as exc:
            ep.error = str(exc)
        ep.timings["open_video"] = time.perf_counter() - t0
        return ep

    def _plan_phase(self, eps: list[_Episode]) -> None:
        self.served.start(eps)  # served teams work on the questions while this team plans and browses
        calls = []
        for e in eps:
            for a in self.policies:
                def build(_k: int, e: _Episode = e, a: PolicyAgent = a) -> list[dict]:
                    return a.plan_messages(e.question)

                calls.append(self._budgeted(_Call(e, a, "plan", [], self.cfg.limits.plan_tokens), build, -1))
        for call, gen in self._plan_draws(calls):
            parsed = call.agent.read_plan(gen.completion, call.ep.question)
            gen.parse_ok, gen.parse_error = parsed.ok, parsed.error
            call.ep.memory.set_plan(call.agent.name, parsed.plan)
            st = call.ep.agents[call.agent.name]
            st.queue, st.key_info = list(parsed.plan.tools), parsed.plan.key_info

    def _plan_draws(self, calls: list[_Call]) -> list[tuple[_Call, Generation]]:
        """The generation of each plan call. With `sampling.distinct_plans` n > 1, the calls of one agent for one
        question sampled above temperature 0 (a GRPO group's rollouts) draw n plans each, and each call in turn takes
        the next draw whose tools no earlier call of the group took (`distinct_order`); the draws not taken are
        spent tokens, not generations of any episode. With `sampling.plan_fill` uniform or shared, a call that would
        repeat a plan takes one no call of the group took, drawn uniformly (`_filled_plan`)."""
        n, drawing = self.cfg.sampling.distinct_plans, defaultdict(list)
        fill = self.cfg.sampling.plan_fill != "repeat"
        for c in calls if n > 1 else []:
            if c.ep.error is None and self._temperature(c) > 0:
                drawing[(c.ep.question.id, c.agent.name)].append(c)
        groups = {key: group for key, group in drawing.items() if len(group) > 1}
        if not groups:
            return self._generate(calls)
        spares = {key: [_Call(c.ep, c.agent, c.phase, c.messages, c.max_tokens) for c in group for _ in range(n - 1)]
                  for key, group in groups.items()}
        drawn = {id(c): gen for c, gen in self._generate(calls + [s for g in spares.values() for s in g],
                                                          record=False)}
        for key, group in groups.items():
            pool = [drawn[id(c)] for c in group + spares[key]]
            tools = [_plan_key(group[0], gen) for gen in pool]
            taken: set = set()
            for c, i in zip(group, distinct_order(tools, len(group))):
                if fill and tools[i] in taken:
                    drawn[id(c)] = self._filled_plan(c, pool[i], taken)
                    taken.add(_plan_key(c, drawn[id(c)]))
                else:
                    drawn[id(c)] = pool[i]
                    taken.add(tools[i])  # the draw's key, read once above
        out = [(c, drawn[id(c)]) for c in calls if id(c) in drawn]
        for c, gen in out:
            c.ep.generations.append(gen)
        return out

    def _filled_plan(self, call: _Call, gen: Generation, taken: set) -> Generation:
        """`gen` rewritten to name a select x browse plan (of the agent's enabled tools) that no episode of the
        group took, drawn uniformly, after the key info the agent wrote: for plans the policy gives too little mass
        to be drawn. Its tokens are the tokenizer's (no sampler log-probs): training scores them as the policy's."""
        options = [p for p in product(SELECT_TOOLS, BROWSE_TOOLS)
                   if p not in taken and all(t in call.agent.tools for t in p)]
        if not options:
            return gen
        if self.cfg.sampling.plan_fill == "shared":  # one uniform order of the plans per question, for every agent
            shuffled = list(product(SELECT_TOOLS, BROWSE_TOOLS))
            random.Random(f"{self._seed}:{self._calls}:{call.ep.question.id}").shuffle(shuffled)
            plan = next(p for p in shuffled if p in options)
        else:
            rng = random.Random(f"{self._seed}:{self._calls}:{call.ep.question.id}:{call.agent.name}:{len(taken)}")
            plan = rng.choice(options)
        head = gen.completion.split("##tool use")[0] if "##tool use" in gen.completion else \
            f"##key info: {call.agent.read_plan(gen.completion, call.ep.question).plan.key_info}\n"
        text = head + "##tool use: " + ", ".join(f"<{t}>" for t in plan)
        chat = self.hub.chat(call.agent.model)
        tokenizer = getattr(chat, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"sampling.plan_fill: {self.cfg.sampling.plan_fill}: model {call.agent.model!r} exposes "
                             f"no tokenizer to write a plan's tokens with (local hf or vllm models do)")
        ends = list(getattr(chat, "eos_ids", None) or [tokenizer.eos_token_id])
        done = gen.completion_ids or []
        end = done[-1] if done and done[-1] in ends else ends[0]
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [end]
        return gen.model_copy(update={"completion": text, "completion_ids": ids, "logprobs": None})

    def _execute_phase(self, eps: list[_Episode]) -> bool:
        """Every agent with plan left and tool budget runs its next tool. Select tools run at
        once; browse requests are gathered and sent in one call per vision model."""
        pending: dict[str, list[tuple[_Episode, str, str, ToolContext, Focus, VisionRequest, list[int]]]] = \
            defaultdict(list)
        acted = False
        for ep in eps:
            for name in self.order:
                st = ep.agents[name]
                st.acted = False
                if not st.queue or st.tool_calls >= self.cfg.limits.max_tool_calls:
                    continue
                tool = st.queue.pop(0)
                st.tool_calls += 1
                st.step += 1
                st.acted = acted = True
                ctx = self._context(ep, st, tool)
                d0 = ctx.video.decode_seconds
                if TOOL_NAMES.get(tool) == "select":
                    self._run_select(ep, name, st, tool, ctx)
                    ep.timings["decode"] += ctx.video.decode_seconds - d0
                    continue
                t0 = time.perf_counter()
                try:
                    if st.focus is None:  # a plan that browses first still needs frames
                        st.focus = global_focus(ctx)
                    model_key = self._vision_key(tool)
                    req, idx = browse.prepare(tool, ctx, st.focus)
                    pending[model_key].append((ep, name, tool, ctx, st.focus, req, idx))
                except (ToolError, VideoError, ValueError) as exc:
                    self._write_turn(ep, name, st, tool, output="", error=f"{tool}: {exc}")
                ep.timings["tools"] += time.perf_counter() - t0
                ep.timings["decode"] += ctx.video.decode_seconds - d0

        jobs = []
        for model_key, items in pending.items():
            params = SamplingParams(max_new_tokens=max(browse.max_tokens(i[2], i[3]) for i in items),
                                    temperature=0.0, logprobs=False)
            jobs.append((self.hub.vision(model_key), items, params))

        def one(job):
            model, items, params = job
            t0 = time.perf_counter()
            replies = model.describe([i[5] for i in items], params)
            return replies, (time.perf_counter() - t0) / len(items)

        keys = list(pending)
        for key, (model, items, _), (replies, dt) in zip(keys, jobs, _map_models(one, jobs, [j[0] for j in jobs])):
            for (ep, name, tool, ctx, focus, _req, idx), reply in zip(items, replies):
                ep.timings["vision"] += dt
                add_usage(ep.usage, key, model, reply)
                res = browse.finish(tool, ctx, focus, reply, idx)
                ep.frames.update(idx)
                self._write_turn(ep, name, ep.agents[name], tool, res.output, timestamps=ctx.video.timestamps(idx),
                                 answer=res.answer, span=res.span, error=res.error)
        return acted

    def _run_select(self, ep: _Episode, name: str, st: _AgentState, tool: str, ctx: ToolContext) -> None:
        t0 = time.perf_counter()
        try:
            res = SELECT[tool](ctx)
            st.focus = res.focus
            self._write_turn(ep, name, st, tool, res.output, timestamps=res.focus.timestamps if res.focus else [])
        except (ToolError, VideoError, ValueError) as exc:
            self._write_turn(ep, name, st, tool, output="", error=f"{tool}: {exc}")
        ep.timings["tools"] += time.perf_counter() - t0

    def _communicate_phase(self, eps: list[_Episode]) -> None:
        calls = []
        for ep in eps:
            for a in self.agents:
                st = ep.agents[a.name]
                if not st.acted or st.tool_calls >= self.cfg.limits.max_tool_calls:
                    continue
                visible = ep.topology.visible_to(a.name)
                own, queue, nxt = ep.memory.render(a.name), list(st.queue), st.queue[0] if st.queue else None

                def build(k, ep=ep, a=a, visible=visible, own=own, queue=queue, nxt=nxt):
                    return a.communicate_messages(ep.question, own, ep.memory.view(a.name, visible, k), queue, nxt)

                calls.append(self._budgeted(_Call(ep, a, "communicate", [], self.cfg.limits.comm_tokens, st.step),
                                            build, self._trimmable(ep, a.name, visible)))
        for call, gen in self._generate(calls):
            parsed = call.agent.read_decision(gen.completion)
            gen.parse_ok, gen.parse_error = parsed.ok, parsed.error
            st = call.ep.agents[call.agent.name]
            d: Decision = parsed.decision
            if d.action == "add_tool" and d.tool:
                st.queue.insert(0, d.tool)
                if d.key_info:
                    st.key_info = d.key_info
            call.ep.memory.set_decision(call.agent.name, d)

    def _answer_phase(self, eps: list[_Episode]) -> None:
        calls = []
        for ep in eps:
            for a in self.policies:
                visible = ep.topology.visible_to(a.name)

                def build(k, ep=ep, a=a, visible=visible):
                    memory = "\n".join(x for x in (ep.memory.render(a.name), ep.memory.view(a.name, visible, k)) if x)
                    return a.answer_messages(ep.question, memory)

                calls.append(self._budgeted(_Call(ep, a, "answer", [], self.cfg.limits.answer_tokens,
                                                  ep.agents[a.name].step), build, self._trimmable(ep, a.name, visible)))
        for call, gen in self._generate(calls):
            parsed = call.agent.read_answer(gen.completion, call.ep.question)
            gen.parse_ok, gen.parse_error = parsed.ok, parsed.error
            call.ep.agents[call.agent.name].answer_gen = gen
            call.ep.answers.append(AgentAnswer(agent=call.agent.name, answer=parsed.answer, reason=parsed.reason,
                                               parse_ok=parsed.ok))
            call.ep.memory.set_answer(call.agent.name, parsed.answer, parsed.reason)
        self.served.finish(add_usage)

    def _aggregate_phase(self, eps: list[_Episode]) -> None:
        agg = self.cfg.aggregation
        need_summary = []
        for ep in eps:
            mode = getattr(agg, ep.question.task)
            ep.aggregation = mode
            if mode == "vote":
                res = aggregate.vote(ep.answers, self.order)
                ep.final = res.answer
                if res.tie or res.answer is None:
                    ep.aggregation = "vote+summary" if res.tie else "summary (no valid vote)"
                    need_summary.append(ep)
            elif mode == "best_score":
                scores = {n: _mean(st.answer_gen.logprobs) if st.answer_gen else None for n, st in ep.agents.items()}
                ep.final = aggregate.best_score(ep.answers, scores, self.order)
            elif mode == "decide_by_agent":
                ep.final = aggregate.decide_by_agent(ep.answers, agg.decider or self.order[0], self.order)
            elif mode == "median":
                ep.final = aggregate.median_span(ep.answers)
            else:
                need_summary.append(ep)
            if ep not in need_summary:
                ep.reason = aggregate.agreeing_reason(ep.answers, ep.final)
        if not need_summary:
            return
        if self.cfg.summarizer in self.served.names:  # served teams only: nobody here writes summaries
            for ep in need_summary:
                ep.final = ep.final or aggregate.fallback_answer(ep.question.task, ep.answers, self.order)
                ep.reason = aggregate.agreeing_reason(ep.answers, ep.final)
                ep.aggregation += " (no summarizer: fallback)"
            return
        summarizer = self.by_name[self.cfg.summarizer]
        calls = []
        for ep in need_summary:
            def build(_k: int, ep: _Episode = ep) -> list[dict]:
                return summarizer.summary_messages(ep.question, [(a.agent, a.answer, a.reason) for a in ep.answers])

            calls.append(self._budgeted(_Call(ep, summarizer, "summary", [], self.cfg.limits.summary_tokens,
                                              ep.agents[summarizer.name].step), build, -1))
        for call, gen in self._generate(calls):
            parsed = call.agent.read_summary(gen.completion, call.ep.question)
            gen.parse_ok, gen.parse_error = parsed.ok, parsed.error
            ep = call.ep
            if (parsed.ok or parsed.lenient) and parsed.answer:
                ep.final, ep.reason = parsed.answer, parsed.reason
            else:  # unreadable summary: fall back to the documented rule
                ep.final = ep.final or aggregate.fallback_answer(ep.question.task, ep.answers, self.order)
                ep.reason = aggregate.agreeing_reason(ep.answers, ep.final) or parsed.reason
                ep.aggregation += " (summary unreadable: fallback)"

    # ------------------------------------------------------------------ helpers
    def _budgeted(self, call: _Call, build: Callable[[int], list[dict]], trimmable: int) -> _Call:
        """`call` with the prompt `build(k)` that fits the prompt budget with the fewest peers' entries k left out
        (m1/team/budget.py). The budget is limits.max_prompt_tokens, or less where the model's context leaves less
        room next to the reply (`budget.context_room`: a prompt the model would refuse is never sent). Over budget
        even then: PromptBudgetError, or with `over_budget: drop` (or `over_budget_rows`) the episode ends (its error
        says why) and `_generate` skips the call."""
        if call.ep.error is not None:  # ended by an earlier prompt of its episode: `_generate` skips it anyway
            return call
        lim = self.cfg.limits
        key = call.agent.model
        if (key, call.max_tokens) not in self._rooms:
            self._rooms[(key, call.max_tokens)] = budget.context_room(self.hub.chat(key), call.max_tokens)
        room = self._rooms[(key, call.max_tokens)]
        limit = min((n for n in (lim.max_prompt_tokens, room) if n is not None), default=None)
        if limit is None:  # no budget and no known context: the whole prompt
            call.messages = build(0)
            return call
        if key not in self._counters:
            self._counters[key] = budget.token_counter(self.hub.chat(key))
        call.messages, call.trimmed, tokens = budget.fit(build, trimmable, self._counters[key], limit)
        if tokens > limit:
            by_context = lim.max_prompt_tokens is None or room is not None and room < lim.max_prompt_tokens
            ctx = getattr(self.hub.chat(key), "context_length", None)
            where = (f"the {room} tokens left for it by the context of model {key!r} ({ctx} tokens, "
                     f"{ctx - room} kept for the reply)" if by_context and room is not None and ctx is not None
                     else None)
            advice: str | None
            if self.over_budget_rows:  # answering: this question's error row, the others go on
                advice = ("shorten the question or its options" if by_context else
                          "shorten the question, or raise limits.max_prompt_tokens")
            else:
                advice = ("use a model with a longer context, or set limits.over_budget: drop to leave such "
                          "questions out" if by_context else None)
            why = budget.over_budget_message(call.agent.name, call.phase, call.ep.question.id, tokens, limit,
                                             trimmable >= 0, where, advice)
            if self.over_budget_rows:
                call.ep.error = f"prompt too long: {why}"
            elif lim.over_budget == "drop":
                call.ep.error = f"dropped: {why}"
            else:
                raise budget.PromptBudgetError(why)
        return call

    @staticmethod
    def _trimmable(ep: _Episode, agent: str, visible: list[str]) -> int:
        """How many entries of the peers' notes a prompt can leave out one by one (-1: it shows no peers)."""
        if not any(p != agent for p in visible):
            return -1
        return ep.memory.peer_turns(agent, visible)

    def _temperature(self, c: _Call) -> float:
        """An episode's own temperature for the agent (`run(temperatures=)`), else the phase's
        (`sampling.phase_temperature`), else the agent's, else the team's."""
        temp = c.agent.temperature if c.agent.temperature is not None else self.cfg.sampling.temperature
        temp = self.cfg.sampling.phase_temperature.get(c.phase, temp)
        return c.ep.temperatures.get(c.agent.name, temp)

    def _generate(self, calls: list[_Call], record: bool = True) -> list[tuple[_Call, Generation]]:
        """One generate call per (model, `_temperature`) for all `calls`, returned in call order; calls
        of an episode dropped over the prompt budget are left out. `record`: each generation joins its episode's
        (else the caller decides which do; the tokens count in the episode's usage either way).

        Calls to different remote models (OpenAI-compatible servers) of one phase overlap in
        threads, so a team whose agents are served separately waits for the slowest, not the sum;
        local models run one after another (they share the CPU/GPU anyway)."""
        calls = [c for c in calls if c.ep.error is None]
        groups: dict[tuple[str, float], list[_Call]] = defaultdict(list)
        for c in calls:
            groups[(c.agent.model, self._temperature(c))].append(c)
        jobs = []
        for (model_key, temp), group in groups.items():
            self._calls += 1
            params = SamplingParams(max_new_tokens=max(c.max_tokens for c in group), temperature=temp,
                                    top_p=self.cfg.sampling.top_p, seed=self._seed + self._calls)
            jobs.append((self.hub.chat(model_key), group, params))

        def one(job):
            model, group, params = job
            t0 = time.perf_counter()
            outs = model.generate([ChatRequest(c.messages) for c in group], params)
            return outs, (time.perf_counter() - t0) / len(group)

        results = _map_models(one, jobs, [j[0] for j in jobs])
        done: dict[int, Generation] = {}
        for (model, group, _), (outs, dt) in zip(jobs, results):
            for c, o in zip(group, outs):
                c.ep.timings["llm"] += dt
                add_usage(c.ep.usage, c.agent.name, model, o)
                gen = Generation(agent=c.agent.name, phase=c.phase, step=c.step, prompt=c.messages,
                                 completion=o.text, prompt_ids=o.prompt_ids, completion_ids=o.completion_ids,
                                 logprobs=o.logprobs, weight_version=o.meta.get("weight_version"),
                                 trimmed=c.trimmed, evidence=list(o.evidence) or None)
                if record:
                    c.ep.generations.append(gen)
                done[id(c)] = gen
        return [(c, done[id(c)]) for c in calls]

    def _timed(self, eps: list[_Episode], name: str, fn: Callable):
        t0 = time.perf_counter()
        result = fn(eps)
        dt = time.perf_counter() - t0
        for e in eps:
            e.timings[f"phase_{name}"] += dt  # wall time of the whole batch's phase
        return result

    def _context(self, ep: _Episode, st: _AgentState, tool: str) -> ToolContext:
        """The CLIP index is handed (and its model loaded) only to the tools that retrieve."""
        clip = self._clip() if tool in TOOLS and TOOLS[tool].clip else None
        return ToolContext(question=ep.question, video=ep.reader, key_info=st.key_info, cfg=self.cfg.tools,
                           focus=st.focus, clip=clip)

    def _vision_key(self, tool: str) -> str:
        key = TOOLS[tool].vision_model(self.cfg.tools)
        if key is None:
            raise ToolError(f"{tool} needs a vision model (tools.browser) and none is configured")
        return key

    def _write_turn(self, ep: _Episode, name: str, st: _AgentState, tool: str, output: str,
                    timestamps: list[float] | None = None, answer: str | None = None,
                    span: tuple[float, float] | None = None, error: str | None = None) -> None:
        ep.memory.add_turn(name, Turn(step=st.step, tool=tool, key_info=st.key_info, output=output,
                                      timestamps=list(timestamps or []), answer=answer, span=span, error=error))

    def _finish(self, ep: _Episode) -> Episode:
        note = None
        if ep.error is None and ep.video is not None and ep.video.changed is not None:
            # an answer never stands on frames of two files
            ep.error, ep.final, ep.reason = f"cannot read video {ep.video.path}: {ep.video.changed}", None, ""
        if ep.error is None and not ep.frames:  # no answer from nothing (docs/cli.md)
            failed = [t.error for r in ep.memory.to_dict().values() for t in r.turns
                      if t.error and "cannot read video" in t.error]
            if failed:
                ep.error = f"no frame could be read, so no answer is given: {failed[0]}"
                ep.final, ep.reason = None, ""
            elif ep.final is not None:
                note = "answered without reading any frame: no agent's plan browsed the video"
        return Episode(note=note, id=ep.question.id, question=ep.question, topology=ep.topology, memory=ep.memory.to_dict(),
                       generations=ep.generations, answers=ep.answers, final_answer=ep.final,
                       final_reason=ep.reason, aggregation=ep.aggregation, frames_used=len(ep.frames),
                       timings=dict(ep.timings), error=ep.error, usage=ep.usage)


def add_usage(table: dict[str, dict], role: str, model, completion) -> None:
    """Count one reply's server-reported tokens under `role` (an agent, or a tool's model key) in `table`
    (Episode.usage), with the served model's name: what a question cost per role on a hosted team. A local model
    reports none and adds nothing."""
    used = completion.meta.get("usage")
    if not used:
        return
    row = table.setdefault(role, {"model": getattr(model, "model_name", None), "calls": 0, "prompt_tokens": 0,
                                  "completion_tokens": 0})
    row["calls"] += 1
    row["prompt_tokens"] += int(used.get("prompt_tokens") or 0)
    row["completion_tokens"] += int(used.get("completion_tokens") or 0)


def _map_models(fn: Callable, jobs: list, models: list) -> list:
    """`fn` over jobs; in threads when there are several and all are remote (I/O-bound)."""
    if len(jobs) > 1 and all(getattr(m, "remote", False) for m in models):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            return list(pool.map(fn, jobs))
    return [fn(j) for j in jobs]


def _mean(xs: list[float] | None) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _plan_key(call: _Call, gen: Generation) -> tuple[str, ...] | None:
    """What makes two plans the same choice: their tools in order (None: a plan that does not parse)."""
    parsed = call.agent.read_plan(gen.completion, call.ep.question)
    return tuple(parsed.plan.tools) if parsed.ok else None


def distinct_order(keys: list, n: int) -> list[int]:
    """Which of the draws `keys` (in the order drawn) n takers get: each the next draw whose key no earlier taker
    has, then, when fewer than n keys were drawn, the earliest draws left. Keeping the first draw of each new key
    of independent draws samples the keys without replacement, each in proportion to its probability."""
    taken: list[int] = []
    seen: set = set()
    for i, key in enumerate(keys):
        if len(taken) < n and key not in seen:
            seen.add(key)
            taken.append(i)
    return taken + [i for i in range(len(keys)) if i not in taken][:n - len(taken)]
