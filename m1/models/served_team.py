"""A served M1 team (`m1 serve`) asked whole questions: the model of a `interface: team` spec (m1/team/member.py).

Why a model of its own and not a chat model: a served team takes the question's video and its question, not a
prompt, and answers with the team's final answer (its reason and per-agent answers under the reply's `m1` field).
So each question goes as `m1 serve` reads it: one `video_url` part (the video's `file://` URL, which the server must
be allowed to read, or with `video_transport: data` the file inlined as a data URL), a text part with the question
and its lettered options, and `m1: {question, options, task, id}` for what a text cannot say.

The HTTP side (retries, concurrency, key hygiene) is the openai backend's. A question the server refuses (a 4xx: an
unreadable video, a question too long) is that question's failed reply, `Completion.meta["error"]`, and the batch
goes on; a server that stops answering raises ServerUnavailable, like any served model.
"""
from __future__ import annotations

import base64
import mimetypes
from pathlib import Path
from typing import Any

from m1.models.base import Completion, ModelError, SamplingParams, ServerUnavailable, request_seeds
from m1.models.openai import _Cancelled, _OpenAIBackend
from m1.schema import LETTERS, Question


def team_request(q: Question, url: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, m1 fields) of one question to a served team, its video at `url`."""
    text = q.text + "".join(f"\n{LETTERS[i]}. {o}" for i, o in enumerate(q.options))
    if q.options:
        text += "\nAnswer with the option's letter from the given choices directly."
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": text}]}]
    return messages, {"m1": {"question": q.text, "options": list(q.options), "task": q.task, "id": q.id}}


class ServedTeamModel(_OpenAIBackend):
    """A whole team behind an OpenAI-compatible `m1 serve` endpoint; `ask` answers a list of questions."""

    def ask(self, questions: list[Question], params: SamplingParams) -> list[Completion]:
        """One Completion per question, in order: `text` the team's answer, `meta["reason"]` its reason,
        `meta["usage"]` the tokens the server counted, `meta["prompt"]` what was sent (a data URL shortened), and
        `meta["error"]` instead when the server refused the question. Raises ServerUnavailable when the server does
        not answer (one such request stops the others of the batch)."""
        seeds = request_seeds(questions, params)
        asked, outs, urls = {}, {}, {}
        for i, q in enumerate(questions):
            try:
                asked[i] = self._request(q, urls)
            except OSError as exc:  # a video gone since the engine opened it: this question's failure only
                outs[i] = Completion(text="", finish_reason="error", meta={
                    "error": f"{self._where()}: cannot read the video {q.video}: {exc}", "prompt": []})
        sent = self._run_batch([asked[i][:2] for i in asked], params, [seeds[i] for i in asked])
        for i, out in zip(asked, sent):
            out.meta["prompt"] = asked[i][2]
            outs[i] = out
        return [outs[i] for i in range(len(questions))]

    def _request(self, q: Question, urls: dict) -> tuple[list[dict], dict, list[dict]]:
        """(messages, m1 fields, the messages as a trace shows them). `urls`: path -> (url, shown) of this batch, so
        the questions of one video share one data URL."""
        path = Path(q.video).resolve()
        if self.spec.video_transport == "file":
            urls[path] = (path.as_uri(), path.as_uri())
        elif path not in urls:
            mime = mimetypes.guess_type(path.name)[0] or ""
            data = path.read_bytes()
            url = f"data:{mime if mime.startswith('video/') else 'video/mp4'};base64," + \
                base64.b64encode(data).decode("ascii")
            urls[path] = (url, f"data:video/...;base64 ({len(data)} bytes of {path})")
        url, shown = urls[path]
        messages, fields = team_request(q, url)
        return messages, fields, team_request(q, shown)[0]

    def _complete(self, asked, params: SamplingParams, seed: int | None, stop=None, extra_body=None) -> Completion:
        """One question with retries (the base's loop); a refusal is a Completion with `meta["error"]`."""
        messages, fields = asked
        try:
            return super()._complete(messages, params, seed, stop, extra_body=fields)
        except (ServerUnavailable, _Cancelled):
            raise
        except ModelError as exc:  # refused (4xx) or no readable reply: this question's failure only
            return Completion(text="", finish_reason="error", meta={"error": str(exc)})

    def _to_completion(self, response: Any) -> Completion:
        out = super()._to_completion(response)
        m1 = (getattr(response, "model_extra", None) or {}).get("m1")
        if isinstance(m1, dict):
            out.meta["reason"] = self._scrub(str(m1.get("reason") or ""))
            out.meta["aggregation"] = m1.get("aggregation")
        return out
