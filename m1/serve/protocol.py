"""The wire format of `m1 serve`: the chat-completions request and reply as pydantic models, and the error body.

The handler works on a validated `ChatCompletionRequest`, never on a raw dict. OpenAI clients send fields the team
does not use (sampling knobs, `user`, `stream_options`, ...): they are declared and marked `IGNORED`, so the openai
package and lmms-eval work unchanged and a reply names those a request set, and any other key is refused by name.
Each field's error is declared on the field (`FieldError`), in the words docs/serving.md documents, whatever
pydantic's own error type was, so a client reads the same 400 for `max_tokens: "8"` as for `max_tokens: 0`;
`FIELD_ERRORS` is read off the models, so a field cannot be added without its message.
"""

import re
import time
import uuid
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Callable, Iterator, Literal, Union, get_args, get_origin

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictFloat,
                      StrictInt, StrictStr, Tag, ValidationError, ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from m1.agents.parsers import answer_in_form
from m1.schema import Episode, Question

OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[.):]\s+(.+?)\s*$")
INSTRUCTION = re.compile(r"^\s*(answer with|please answer|respond with|select the best|best option)", re.I)
TASKS = ("mcq", "open", "grounding", "numeric")
DEFAULT_FRAME_FPS = 1.0


class ApiError(Exception):
    """A request the server refuses: its HTTP status, an OpenAI-style error type, and a message naming the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(msg: str, param: str | None = None) -> ApiError:
    return ApiError(400, msg, param)


# ------------------------------------------------------------------ request

@dataclass(frozen=True)
class FieldError:
    """The 400 a client gets for a fault in the field it annotates (`Annotated[T, FieldError(...)]`): a message, and
    what to append to the field's place in `param` (e.g. ".url"); each a text or a function of the value sent."""

    message: str | Callable[[Any], str]
    param: str | Callable[[Any], str] = ""

    def __call__(self, value: Any) -> tuple[str, str]:
        return tuple(x(value) if callable(x) else x for x in (self.message, self.param))


class _Ignored:
    def __repr__(self) -> str:
        return "IGNORED"


IGNORED = _Ignored()  # on a field: accepted (and type-checked), then not used; a reply names those a request set


def _url(val: Any) -> Any:
    """A media part's URL: `{"url": ...}` as the chat API writes it, or a bare string as some harnesses send."""
    return val.get("url") if isinstance(val, dict) else val


def _non_empty(s: str) -> str:
    if not s.strip():
        raise ValueError("empty")
    return s


def _fps(v: Any) -> float | None:
    """A frame rate a client asked for, if it is a usable one; anything else is ignored (a hint, not a field)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 120 else None


Url = Annotated[StrictStr, Field(min_length=1), BeforeValidator(_url)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. image_url's "detail": not ours to judge


class TextPart(_Part):
    type: Literal["text"]
    text: Annotated[StrictStr, FieldError("a text part needs a text string")]


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: Annotated[Url, FieldError("video_url needs a url string", ".url")]


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: Annotated[Url, FieldError("image_url needs a url string", ".url")]
    fps: Any = None  # the rate of the clip the frames make; used only when a number in (0, 120]


def _tag(field: str, tags: dict) -> Callable[[Any], str | None]:
    """A discriminator on `field` of a dict; None (refused) for anything else, so the error names the part."""
    return lambda v: next((t for k, t in tags.items() if v.get(field) == k), None) if isinstance(v, dict) else None


# The tags are not field names, so an error's location reads as the client's field path (see _path).
Part = Annotated[Union[Annotated[TextPart, Tag("text part")], Annotated[VideoPart, Tag("video part")],
                       Annotated[ImagePart, Tag("image part")]],
                 Discriminator(_tag("type", {"text": "text part", "video_url": "video part",
                                             "image_url": "image part"})),
                 FieldError(lambda v: f"unsupported content part type {v.get('type')!r}: text, video_url and "
                                      "image_url are served" if isinstance(v, dict) else
                                      "each content part must be an object",
                            lambda v: ".type" if isinstance(v, dict) else "")]
Content = Annotated[Union[Annotated[StrictStr, Tag("string")], Annotated[list[Part], Tag("parts")]],
                    Discriminator(lambda v: "string" if isinstance(v, str) else "parts" if isinstance(v, list)
                                  else None)]


class UserMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # "name" and the like
    role: Literal["user"]
    content: Annotated[Content, FieldError("content must be a string or a list of parts")]


class OtherMessage(BaseModel):
    """A system prompt or an earlier turn: skipped unread (the team has its own prompts), so its content may be
    anything."""

    model_config = ConfigDict(extra="ignore")
    role: Annotated[Literal["system", "assistant", "developer"],
                    FieldError(lambda v: f"role {v!r}: expected user, system, developer or assistant")]


Message = Annotated[Union[Annotated[UserMessage, Tag("user turn")], Annotated[OtherMessage, Tag("other turn")]],
                    Discriminator(lambda m: ("user turn" if m.get("role") == "user" else "other turn")
                                  if isinstance(m, dict) else None),
                    FieldError("each message must be an object")]


class M1Fields(BaseModel):
    """`m1: {question, options, task, id}`: the question as fields, for what a text cannot say (a numeric or
    grounding task, options that are not lettered lines). A key that is present is checked, even when null."""

    model_config = ConfigDict(extra="allow")
    question: Annotated[StrictStr, FieldError("m1.question must be a string")] = None
    options: Annotated[list[Annotated[StrictStr, AfterValidator(_non_empty)]], Field(max_length=26),
                       FieldError("m1.options must be a list of at most 26 non-empty strings")] = None
    task: Annotated[Literal[TASKS], FieldError(lambda v: f"m1.task {v!r}: one of {', '.join(TASKS)}")] = None
    id: Any = None  # used when a non-empty string, else the server makes one


class ChatCompletionRequest(BaseModel):
    """One chat-completions body. Fields are declared in the order they are checked, and a client is told its
    first fault (`request_error`). Validate with `from_body`: the model check needs the served model's name."""

    model_config = ConfigDict(extra="forbid")

    # IGNORED marks what OpenAI clients send and the team does not use: its own config decides its decoding
    stream: Annotated[Any, FieldError("stream: true is not supported; send stream: false (or leave it out)")] = None
    model: Any = None  # another model's name is a 404 (`_served`)
    n: Annotated[Any, FieldError(lambda v: f"n = {v!r}: one answer per request")] = None
    max_tokens: Annotated[PositiveInt | None, IGNORED,
                          FieldError(lambda v: f"max_tokens must be a positive integer, got {v!r}")] = None
    max_completion_tokens: Annotated[PositiveInt | None, IGNORED, FieldError(
        lambda v: f"max_completion_tokens must be a positive integer, got {v!r}")] = None
    temperature: Annotated[StrictInt | StrictFloat | None, IGNORED,
                           FieldError(lambda v: f"temperature must be a number, got {v!r}")] = None
    media_io_kwargs: Annotated[dict[str, Any] | None, FieldError("media_io_kwargs must be an object")] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, IGNORED,
                                   FieldError("mm_processor_kwargs must be an object")] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, IGNORED,
                                    FieldError("chat_template_kwargs must be an object")] = None
    m1: Annotated[M1Fields | None, FieldError("m1 must be an object {question, options, task}")] = None
    messages: Annotated[list[Message], Field(min_length=1), FieldError("messages must be a non-empty list")]
    extra_body: Any = None  # read for its m1 (`_m1_from_extra_body`)
    top_p: Annotated[Any, IGNORED] = None
    user: Annotated[Any, IGNORED] = None
    seed: Annotated[Any, IGNORED] = None
    stop: Annotated[Any, IGNORED] = None
    stream_options: Annotated[Any, IGNORED] = None
    frequency_penalty: Annotated[Any, IGNORED] = None
    presence_penalty: Annotated[Any, IGNORED] = None
    logprobs: Annotated[Any, IGNORED] = None
    top_logprobs: Annotated[Any, IGNORED] = None
    response_format: Annotated[Any, IGNORED] = None

    @model_validator(mode="before")
    @classmethod
    def _m1_from_extra_body(cls, data: Any) -> Any:
        """A client that passed `extra_body={"m1": ...}` to a library that sends it as a field of its own."""
        if isinstance(data, dict) and data.get("m1") is None and isinstance(data.get("extra_body"), dict):
            return {**data, "m1": data["extra_body"].get("m1")}
        return data

    @field_validator("stream")
    @classmethod
    def _not_streaming(cls, v: Any) -> Any:
        if v not in (None, False):
            raise ValueError("stream")
        return v

    @field_validator("model")
    @classmethod
    def _served(cls, v: Any, info: ValidationInfo) -> Any:
        served = (info.context or {}).get("served_model")
        if v is not None and served is not None and v != served:
            raise PydanticCustomError("model_not_found", "model {model} is not served here; this server serves "
                                      "{served}", {"model": repr(v), "served": repr(served)})
        return v

    @field_validator("n")
    @classmethod
    def _one_answer(cls, v: Any) -> Any:
        if v not in (1, None):
            raise ValueError("n")
        return v

    @classmethod
    def from_body(cls, body: Any, served_model: str) -> "ChatCompletionRequest":
        """The validated request, or the ApiError a client gets for its first fault."""
        try:
            return cls.model_validate(body, context={"served_model": served_model})
        except ValidationError as exc:
            raise request_error(exc) from None

    def parts(self) -> Iterator[tuple[str, TextPart | VideoPart | ImagePart]]:
        """Each part of the user turns with its place (`messages[i].content[j]`); a string content is a text part."""
        for i, msg in enumerate(self.messages):
            if not isinstance(msg, UserMessage):
                continue
            if isinstance(msg.content, str):
                yield f"messages[{i}]", TextPart(type="text", text=msg.content)
                continue
            for j, part in enumerate(msg.content):
                yield f"messages[{i}].content[{j}]", part

    @property
    def frame_fps(self) -> float:
        """The rate image frames are encoded at: an image part's `fps`, else `media_io_kwargs.video.fps`, else 1."""
        fps = DEFAULT_FRAME_FPS
        video = (self.media_io_kwargs or {}).get("video")
        if isinstance(video, dict) and _fps(video.get("fps")) is not None:
            fps = _fps(video["fps"])
        for _, part in self.parts():
            if isinstance(part, ImagePart) and _fps(part.fps) is not None:
                fps = _fps(part.fps)
        return fps

    def media(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(video URLs, image URLs), each with its part's place; 400 unless they make exactly one video."""
        videos = [(p.video_url, q) for q, p in self.parts() if isinstance(p, VideoPart)]
        images = [(p.image_url, q) for q, p in self.parts() if isinstance(p, ImagePart)]
        if videos and images:
            raise bad("send one video: a video_url part or image_url frames, not both", "messages")
        if len(videos) > 1:
            raise bad(f"{len(videos)} video_url parts: one video per request", "messages")
        if not videos and not images:
            raise bad("no video: add a video_url part or image_url frames", "messages")
        return videos, images

    def question(self, max_text_chars: int) -> Question:
        """The Question this request asks, validated as `m1 infer` validates a line (`check_question`); its video
        is "<upload>" until the media are read. A text over `max_text_chars` is a 413 before any model sees it."""
        from m1.data.records import check_question  # m1.data's imports are not needed to start the CLI

        self.media()  # one video, checked before the text: the order the hand-written parser had
        texts = [p.text for _, p in self.parts() if isinstance(p, TextPart)]
        check_text(sum(len(t) for t in texts), max_text_chars)
        question, options = split_options("\n".join(t for t in texts if t.strip()))
        extra = self.m1 or M1Fields()
        given = extra.model_fields_set
        if "question" in given:
            question = extra.question.strip()
        if "options" in given:
            options = list(extra.options)
        check_text(len(question) + sum(len(o) for o in options), max_text_chars)
        if not question:
            raise bad("no question: add a text part (or m1.question)", "messages")
        task = extra.task if "task" in given else ("mcq" if options else "open")
        if task == "mcq" and not options:
            raise bad("an mcq question needs options (lettered lines A. ... or m1.options)", "m1.options")
        qid = extra.id if isinstance(extra.id, str) and extra.id.strip() else uuid.uuid4().hex[:16]
        q, problem = check_question({"id": qid, "video": "<upload>", "text": question, "options": options,
                                     "task": task})
        if problem:  # the one validation m1 infer and m1 eval apply to a questions line
            raise bad(f"invalid question: {problem}", "m1" if given or extra.model_extra else "messages")
        return q


def check_text(n: int, max_text_chars: int) -> None:
    """413 for a question text (with its options) of more than `max_text_chars` characters: it is refused before
    any tokenizer sees it (a 50 MB question would take minutes and GBs there before failing)."""
    if n > max_text_chars:
        raise ApiError(413, f"the question text is {n} characters: at most {max_text_chars} (--max-text-kb); "
                            "a prompt that long does not fit the team's models", "messages")


def split_options(text: str) -> tuple[str, list[str]]:
    """A question text as lmms-eval and most harnesses write it: the question, then lettered option lines
    (`A. ...`, `A) ...`, `(A) ...`), then perhaps an instruction line ("Answer with the option's letter ...").
    Options are taken only when they run A, B, C, ... in order, so a sentence starting "I. " is left alone."""
    lines = text.strip().splitlines()
    options, first = [], None
    for i, line in enumerate(lines):
        m = OPTION_LINE.match(line)
        if m and m.group(1) == chr(ord("A") + len(options)) and (first is None or i == first + len(options)):
            first = i if first is None else first
            options.append(m.group(2))
    if len(options) < 2:
        return text.strip(), []
    rest = [ln for i, ln in enumerate(lines) if not first <= i < first + len(options) and not INSTRUCTION.match(ln)]
    return "\n".join(rest).strip(), options


# ------------------------------------------------------------------ a validation error -> the client's 400

def fields(tp: Any, path: str = "") -> Iterator[tuple[str, list]]:
    """Each place in a request type as (path, the markers declared there), models nested in unions and lists
    included; a path joins field names with "." and "*" for any list item. A place may come more than once."""
    if get_origin(tp) is Annotated:
        base, *marks = get_args(tp)
        yield path, marks
        yield from fields(base, path)
    elif get_origin(tp) in (Union, UnionType):
        for t in get_args(tp):
            yield from fields(t, path)
    elif get_origin(tp) is list:
        yield from fields(get_args(tp)[0], f"{path}.*" if path else "*")
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        for name, info in tp.model_fields.items():
            sub = f"{path}.{name}" if path else name
            yield sub, info.metadata
            yield from fields(info.annotation, sub)


# The error of each field's fault, by the field's path. A fault deeper than any path here is reported by the
# nearest field above it that has one; the body itself ("") when none.
FIELD_ERRORS: dict[str, FieldError] = {
    "": FieldError("the body must be a JSON object"),
    **{path: m for path, marks in fields(ChatCompletionRequest) for m in marks if isinstance(m, FieldError)}}
IGNORED_FIELDS = tuple(name for name, info in ChatCompletionRequest.model_fields.items()
                       if any(m is IGNORED for m in info.metadata))
_FIELDS = {name for path in FIELD_ERRORS for name in path.split(".")} - {"*", ""}


def _path(loc: tuple) -> list[tuple[str, str]]:
    """An error location as (path segment, param text) pairs: `("messages", 0, "user turn", "content")` ->
    messages / [0] / .content. Union tags and pydantic's branch names ("int", "float") are not fields: dropped."""
    out = []
    for x in loc:
        if isinstance(x, int):
            out.append(("*", f"[{x}]"))
        elif x in _FIELDS:
            out.append((x, f".{x}" if out else x))
    return out


def request_error(exc: ValidationError) -> ApiError:
    """The one error a client gets for an invalid body: an unknown field first (the first by name), else the first
    fault in field order, m1's own fields last (they are read once the messages are)."""
    errors = exc.errors(include_url=False)
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1)
    if unknown:
        return bad(f"unsupported field {unknown[0]!r}", unknown[0])
    e = min(errors, key=lambda e: e["loc"][:1] == ("m1",) and len(e["loc"]) > 1)
    if e["type"] == "model_not_found":
        return ApiError(404, e["msg"], "model", "not_found_error")
    path = _path(e["loc"])
    for n in range(len(path), -1, -1):
        key = ".".join(seg for seg, _ in path[:n])
        if key in FIELD_ERRORS:
            value = None if e["type"] == "missing" or n < len(path) else e["input"]
            msg, suffix = FIELD_ERRORS[key](value)
            param = "".join(p for _, p in path[:n]) + suffix
            return bad(msg, param or None)
    return bad("malformed request")  # not reached: "" is listed


def ignored_fields(body: dict) -> list[str]:
    """The IGNORED fields a valid body set (not null), for its reply's `m1.ignored`."""
    return [name for name in IGNORED_FIELDS if body.get(name) is not None]


# ------------------------------------------------------------------ reply

def _tokens(messages_or_text, ids) -> int:
    """Tokens of one side of a call: the model's own ids when the backend returned them, else whitespace-separated
    words (rule-based backends have no tokenizer)."""
    if ids is not None:
        return len(ids)
    if isinstance(messages_or_text, str):
        return len(messages_or_text.split())
    n = 0
    for m in messages_or_text or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c.split())
        elif isinstance(c, list):
            n += sum(len(p.get("text", "").split()) for p in c if isinstance(p, dict))
    return n


class ReplyMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ReplyMessage
    finish_reason: str = "stop"
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AgentReply(BaseModel):
    answer: str
    parse_ok: bool


class M1Reply(BaseModel):
    """What the chat API has no field for: how the team reached its answer, and where its trace page is."""

    answer: str
    reason: str
    aggregation: str
    agents: dict[str, AgentReply]
    frames_used: int
    calls: int
    trace_url: str
    ignored: list[str] = []  # the request's fields the server did not use (IGNORED_FIELDS)
    question_id: str = ""  # the request's m1.id (or the one the server drew): several requests may share it
    # whether `answer` is in the exact form for the task (`answer_in_form`, a results row's `answer_ok`): a null
    # answer ("" here and in the content) or an open question answered "D" is false, so a client can tell it
    answer_ok: bool = False


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    m1: M1Reply

    @classmethod
    def from_episode(cls, ep: Episode, team_name: str, trace_url: str, ignored: list[str] | None = None,
                     reply_id: str | None = None) -> "ChatCompletionResponse":
        """The reply to one request. Its `id` is the reply's own (`reply_id`, else a fresh one), never the question's:
        clients that send one m1.id with several requests still tell the replies apart; m1.question_id keeps it."""
        prompt = sum(_tokens(g.prompt, g.prompt_ids) for g in ep.generations)
        completion = sum(_tokens(g.completion, g.completion_ids) for g in ep.generations)
        answer = ep.final_answer if ep.final_answer is not None else ""
        return cls(
            id=f"chatcmpl-{reply_id or uuid.uuid4().hex}", created=int(time.time()), model=team_name,
            choices=[Choice(message=ReplyMessage(content=answer))],
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
            m1=M1Reply(answer=answer, reason=ep.final_reason, aggregation=ep.aggregation,
                       agents={a.agent: AgentReply(answer=a.answer, parse_ok=a.parse_ok) for a in ep.answers},
                       frames_used=ep.frames_used, calls=len(ep.generations), trace_url=trace_url,
                       ignored=ignored or [], question_id=ep.id,
                       answer_ok=answer_in_form(ep.final_answer, ep.question)))
