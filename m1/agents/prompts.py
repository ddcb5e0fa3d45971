"""What the policy agents and the browsing VLMs are asked, in each phase.

Pure functions returning OpenAI-style message lists (or, for the VLM, one prompt string). The
formats (`##key info`, `##tool use`, `##tool call`, `##Answer`/`##Reason`, `##Timestamp`,
`##Final Answer`/`##Reason Summary`) follow the VideoChat-M1 paper so `parsers.py` can read
them strictly; every sentence here is our own wording.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from m1.agents.parsers import MAX_PLAN_TOOLS, format_span, format_time, parse_span
from m1.agents.reading import normalize_number, normalize_option
from m1.registry import (BROWSE_TOOLS, FINE_BROWSER, GLOBAL_SAMPLING, GROUNDING_TOOL, ROUGH_BROWSER, SELECT_TOOLS,
                         TOOLS, VIDEO_RETRIEVAL)
from m1.schema import LETTERS, Question

__all__ = ["render_question", "plan_messages", "communicate_messages",
           "answer_messages", "summary_messages", "browser_prompt", "BROWSER_KINDS"]

_TASK_LINE = {
    "mcq": "multiple choice - the answer is the letter of one option",
    "open": "open-ended - the answer is a short free-text reply",
    "grounding": "temporal grounding - the answer is the start and end of the moment, in seconds of the video",
    "numeric": "numeric - the answer is a single number",
}

_ANSWER_SLOT = {
    "mcq": "<option letter>",
    "open": "<short answer>",
    "grounding": "[s - e]",
    "numeric": "<number>",
}

# One worked plan per task: (question, key info, preferred select tool, preferred browse tool).
_PLAN_EXAMPLE = {
    "mcq": ("What colour is the umbrella the woman opens at the bus stop?",
            "the woman at the bus stop opening an umbrella, and the umbrella's colour",
            VIDEO_RETRIEVAL.name, ROUGH_BROWSER.name),
    "open": ("What does the boy do right after he drops his ice cream?",
             "the boy dropping his ice cream and his next action", VIDEO_RETRIEVAL.name, ROUGH_BROWSER.name),
    "grounding": ("When does the man close the fridge door?", "the man closing the fridge door",
                  VIDEO_RETRIEVAL.name, GROUNDING_TOOL.name),
    "numeric": ("How many times does the dog jump over the fence?", "each jump of the dog over the fence",
                GLOBAL_SAMPLING.name, FINE_BROWSER.name),
}


def _task(question: Question) -> str:
    if question.task not in _TASK_LINE:
        raise ValueError(f"question {question.id!r}: unknown task {question.task!r} (known: {list(_TASK_LINE)})")
    return question.task


def render_question(question: Question) -> str:
    """The question block every prompt shows: text, lettered options (if any) and the task."""
    lines = [f"Question: {question.text.strip()}"]
    if question.options:
        lines += ["Options:", question.options_block()]
    lines.append(f"Task: {_TASK_LINE[_task(question)]}")
    return "\n".join(lines)


def _check_tools(tools: Sequence[str]) -> list[str]:
    tools = list(tools)
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise ValueError(f"tools: unknown tool(s) {bad} (known: {list(TOOLS)})")
    return tools


def _tool_menu(tools: Sequence[str]) -> str:
    """The enabled tools, one line each, in the two groups a plan must draw from."""
    sel = [t for t in tools if t in SELECT_TOOLS]
    brw = [t for t in tools if t in BROWSE_TOOLS]
    lines = ["Selection tools (decide which frames of the video are used):"]
    lines += [f"- {t}: {TOOLS[t].blurb}" for t in sel] or ["- (none enabled)"]
    lines.append("Browsing tools (look at the selected frames and report what they show):")
    lines += [f"- {t}: {TOOLS[t].blurb}" for t in brw] or ["- (none enabled)"]
    return "\n".join(lines)


def _pick(preferred: str, group: Sequence[str], tools: Sequence[str]) -> str:
    if preferred in tools:
        return preferred
    return next((t for t in tools if t in group), preferred)


def plan_messages(question: Question, tools: Sequence[str]) -> list[dict]:
    """Ask for a tool plan: `##key info: ...` then `##tool use: <A>, <B>`."""
    tools = _check_tools(tools)
    task = _task(question)
    system = (
        "You plan the work of one agent that answers questions about a video. You never see the "
        "video yourself: you choose tools, where selection tools pick the frames to use and "
        "browsing tools look at those frames and describe them.\n\n"
        f"{_tool_menu(tools)}\n\n"
        "Rules for a plan:\n"
        "- Choose at least one selection tool and at least one browsing tool.\n"
        "- Write every selection tool before the browsing tools; they run in the order given.\n"
        f"- Use at most {MAX_PLAN_TOOLS} tools, and only tools named in the lists above.\n"
        "- The smallest plan that can settle the question is the best one."
    )
    ex_q, ex_key, ex_sel, ex_brw = _PLAN_EXAMPLE[task]
    ex_sel, ex_brw = _pick(ex_sel, SELECT_TOOLS, tools), _pick(ex_brw, BROWSE_TOOLS, tools)
    user = (
        f"{render_question(question)}\n\n"
        "First state the key info: the object, event, time or relation the answer depends on; "
        "the tools will search and describe with it. Then list the tools to run.\n"
        "Reply with exactly these two lines and nothing else:\n"
        "##key info: <what the tools should look for>\n"
        "##tool use: <Tool A>, <Tool B>\n\n"
        f"Example for another question (\"{ex_q}\"):\n"
        f"##key info: {ex_key}\n"
        f"##tool use: <{ex_sel}>, <{ex_brw}>"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def communicate_messages(question: Question, own_memory: str, peers_memory: str,
                         remaining_plan: Sequence[str], next_tool: str | None,
                         tools: Sequence[str]) -> list[dict]:
    """Ask whether to keep the plan (`continue()`) or insert one tool (`add tool <X>`)."""
    tools = _check_tools(tools)
    peers = peers_memory.strip() or "No output from other agents is visible to you."
    remaining = ", ".join(remaining_plan) if remaining_plan else "none"
    if next_tool:
        nxt = f"Next tool: {next_tool}"
        keep = f"keep the plan and run {next_tool} next"
    else:
        nxt = "Next tool: none - the plan is finished and the agent answers next"
        keep = "keep the plan; the agent then moves on to answering"
    system = (
        "You oversee one agent of a team that answers a question about a video. After each tool "
        "call you check the agent's notes, and what the other agents found, and decide whether the "
        "rest of the plan still makes sense.\n\n"
        f"{_tool_menu(tools)}"
    )
    user = (
        f"{render_question(question)}\n\n"
        f"Your notes so far:\n{own_memory.strip() or '(nothing yet)'}\n\n"
        f"Notes from other agents:\n{peers}\n\n"
        f"Tools left in your plan: {remaining}\n{nxt}\n\n"
        "Choose one action:\n"
        f"- continue(): {keep}. This is the usual choice: take it when your notes look sound and "
        "the other agents show nothing your plan misses.\n"
        "- add tool <Tool>: only when the notes show the plan cannot settle the question (the wrong "
        "part of the video, a missing detail, a tool error) or another agent found something your "
        "plan would miss. Name one tool from the lists above and say what it should look for.\n\n"
        "Reply in exactly one of these two forms and nothing else:\n"
        "##tool call: continue()\n\n"
        "or\n\n"
        "##tool call: add tool <Tool name>\n"
        "##key info: <what the added tool should look for>"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _answer_rules(task: str, options: Sequence[str]) -> str:
    if task == "mcq":
        letters = ", ".join(LETTERS[:len(options)]) if options else "A, B, C, ..."
        return (f"Answer with one option letter ({letters}) - the letter alone, without the option text.\n"
                "Reply in exactly this form:\n"
                "##Answer: <option letter>\n"
                "##Reason: <one or two sentences pointing to the notes>")
    if task == "numeric":
        return ("Answer with a single number (digits only, no units).\n"
                "Reply in exactly this form:\n"
                "##Answer: <number>\n"
                "##Reason: <one or two sentences pointing to the notes>")
    if task == "grounding":
        return ("Answer with the start and end of the moment, in seconds from the start of the video, "
                "start first (for example [12.5 - 20.0]). The timestamp is the answer, so no ##Answer "
                "line is needed.\n"
                "Reply in exactly this form:\n"
                "##Timestamp: [s - e]\n"
                "##Reason: <one or two sentences pointing to the notes>")
    return ("Answer in a few words or one short sentence.\n"
            "Reply in exactly this form:\n"
            "##Answer: <short answer>\n"
            "##Reason: <one or two sentences pointing to the notes>")


def answer_messages(question: Question, memory: str) -> list[dict]:
    """Ask for the agent's own answer, from its memory only."""
    task = _task(question)
    system = (
        "You write the final answer of one agent on a team that answers questions about a video. "
        "Rely only on the notes the agent's tools wrote; do not add outside knowledge. If the notes "
        "do not settle the question, give the answer they make most likely."
    )
    user = (
        f"{render_question(question)}\n\n"
        f"Notes from the tools:\n{memory.strip() or '(no notes)'}\n\n"
        f"{_answer_rules(task, question.options)}"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _consensus(question: Question, answers: Sequence[tuple[str, str, str]]) -> str:
    """A one-line tally of the agents' answers, so the summarizer need not count."""
    keys = []
    for _, ans, _ in answers:
        if question.task == "mcq":
            key = normalize_option(ans, question.options)[0]
        elif question.task == "numeric":
            key = normalize_number(ans)
        else:
            key = None
        if key:
            keys.append(key)
    if not keys:
        return "No agent gave a readable answer."
    counts = Counter(keys).most_common()
    top = [k for k, c in counts if c == counts[0][1]]
    if len(top) == 1:
        return f"Most common answer: {top[0]} ({counts[0][1]} of {len(answers)} agents)."
    return f"No single majority; tied answers: {', '.join(top)} ({counts[0][1]} agents each)."


def summary_messages(question: Question, answers: Sequence[tuple[str, str, str]]) -> list[dict]:
    """Ask the summarizer for the team answer: `##Final Answer: ...` + `##Reason Summary: ...`."""
    task = _task(question)
    lines = []
    for name, ans, reason in answers:
        if task == "grounding":
            span = parse_span(ans)
            ans = format_span(span) if span else ans
        lines.append(f"- {name}: answer {ans.strip() or '(none)'}; reason: {reason.strip() or '(none)'}")
    board = "\n".join(lines) or "(no agent answered)"
    if task in ("mcq", "numeric"):
        slot = _ANSWER_SLOT[task]
        how = (f"{_consensus(question, answers)}\n"
               "Take the answer most agents agree on as the final answer (keep it unless their reasons "
               "clearly fail). Summarise only the reasons of the agents who gave that answer; leave the "
               "others out unless they add a fact the final answer needs.")
    elif task == "grounding":
        slot = "[s - e]"
        how = ("Give one time span, in seconds of the video, that best reflects the agents' spans; spans "
               "that overlap with each other count most. Summarise all the reasons, stressing where they agree.")
    else:
        slot = _ANSWER_SLOT[task]
        how = ("Write one short answer that reflects every agent, giving most weight to what several agents "
               "agree on, and summarise all their reasons, stressing the points they share.")
    system = ("You merge the answers of several agents, who studied the same video, into one team answer "
              "with one short, accurate paragraph of reasons.")
    user = (
        f"{render_question(question)}\n\n"
        f"Agents' answers:\n{board}\n\n"
        f"{how}\n"
        "Reply in exactly this form:\n"
        f"##Final Answer: {slot}\n"
        "##Reason Summary: <one short paragraph>"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


BROWSER_KINDS = ("rough", "fine", "space", "grounding")

_BROWSER_INTRO = {
    "rough": "The {n} frames below are spread over the part of the video chosen for you.",
    "fine": "The {n} frames below are sampled densely from one clip of the video, so small details and "
            "quick movements can be seen.",
    "space": "The {n} frames below show a scene from a video. Work out where the objects are relative "
             "to one another: left or right, in front or behind, near or far, sizes and distances.",
    "grounding": "The {n} frames below come from a video; each is labelled with its time in seconds "
                 "from the start of the video.",
}


def browser_prompt(kind: str, question: Question, key_info: str, timestamps: Sequence[float],
                   max_tokens: int) -> str:
    """The text a browsing VLM gets with its frames: a focused summary of at most `max_tokens`
    tokens and, when it can tell, an answer line; grounding asks for a `[s - e]` span."""
    if kind not in BROWSER_KINDS:
        raise ValueError(f"browser_prompt: unknown kind {kind!r} (known: {list(BROWSER_KINDS)})")
    if max_tokens < 1:
        raise ValueError(f"browser_prompt: max_tokens must be >= 1, got {max_tokens}")
    task = _task(question)
    ts = list(timestamps)
    if kind == "grounding":
        times = "\n".join(f"frame {i + 1}: {t:.1f} s ({format_time(t)})" for i, t in enumerate(ts))
    else:
        times = "\n".join(f"frame {i + 1}: {format_time(t)}" for i, t in enumerate(ts))
    focus = key_info.strip() or question.text.strip()
    head = (f"{_BROWSER_INTRO[kind].format(n=len(ts))}\n"
            f"Frame times:\n{times or '(unknown)'}\n\n"
            f"{render_question(question)}\n"
            f"Focus (key info): {focus}\n\n")
    if kind == "grounding":
        return head + (
            "Find the moment the focus describes and give its start and end in seconds of the video, "
            "using the frame times above. Then justify it briefly, in at most "
            f"{max_tokens} tokens.\n"
            "Reply in exactly this form:\n"
            "##Timestamp: [s - e]\n"
            "##Reason: <why this span>"
        )
    what = {
        "rough": "Write one short paragraph about what the frames show concerning the focus",
        "fine": "Write a careful paragraph about what the frames show concerning the focus, including "
                "small details such as text, hands and fast movements",
        "space": "Write a paragraph naming the objects that matter for the focus and where each one is "
                 "relative to the others",
    }[kind]
    slot = "[s - e] (seconds of the video)" if task == "grounding" else _ANSWER_SLOT[task]
    return head + (
        f"{what}; leave out anything unrelated. Keep it under {max_tokens} tokens. If the frames are "
        "enough to answer the question, add the answer as well.\n"
        "Reply in this form:\n"
        "##Summary: <your paragraph>\n"
        f"##Answer: {slot}   (write this line only if the frames settle the question)"
    )

