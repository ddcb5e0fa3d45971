"""The FastAPI app: routes, the API key, the body-size limit, and one JSON error per refused request.

Everything a client sends is untrusted: each bad request gets one JSON error with the status a client can act on
(400, 401, 413, 429 with Retry-After, 504) and never a stack trace; a body over the limit is a 413 before it is
read whole; a client that hangs up mid-body is one log line, not an internal error, and one that hangs up before
its answer is one log line too, its request dropped from the queue. The API key is compared in constant time and
never written anywhere (logs, traces, errors). FastAPI is imported when an app is made: the `serve` extra is
optional, and `m1 serve` says how to install it when it is missing.
"""

import asyncio
import hmac
import json
import logging
import tempfile
import threading
import uuid
import zlib
from collections import OrderedDict
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from m1.contracts import Team
from m1.schema import Episode, Question
from m1.serve.batcher import Batcher, cleanup
from m1.serve.limits import Limits
from m1.serve.media import video_file
from m1.serve.protocol import ApiError, ChatCompletionRequest, ChatCompletionResponse, bad, ignored_fields

log = logging.getLogger("m1.serve")  # one logger for the whole server: operators filter on it


def server_storage_error(exc: OSError) -> ApiError | None:
    """What a client is told when the server's own disk or file table fails it (not the request's fault): a full
    temp folder is 507, a read-only one or too many open files 503 with Retry-After; the operator gets one log line
    naming the place and the setting that moves it. None: not such an error (the caller re-raises)."""
    import errno

    from m1.errors import env_advice

    where = exc.filename or tempfile.gettempdir()
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        log.error("no room for an upload in %s: free space, or %s", where, env_advice("TMPDIR"))
        return ApiError(507, "the server has no room to store the upload; try again later", kind="server_error")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        log.error("cannot write an upload in %s (%s): %s", where, exc.strerror, env_advice("TMPDIR"))
        return ApiError(503, "the server cannot store uploads now; try again later", kind="server_error")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        log.error("too many open files (%s): raise `ulimit -n` or lower limits.max_open_videos", exc.strerror)
        return ApiError(503, "the server is out of file handles; try again shortly", kind="server_error",
                        headers={"Retry-After": "5"})
    return None


def parse_request(body: object, team_name: str, limits: Limits, tmp: Path) -> Question:
    """The Question one chat-completions body asks, its video readable (written under `tmp` when sent inline).
    Raises ApiError naming the field for anything the server cannot answer. Blocking (files, video decoding):
    the app runs it in a worker thread."""
    req = ChatCompletionRequest.from_body(body, team_name)
    q = req.question(limits.max_text_chars)
    return q.model_copy(update={"video": str(video_file(req, limits, tmp))})


class TraceStore:
    """The episodes of the last requests, for their trace pages, bounded in count and bytes: each kept as compressed
    JSON without token ids and log-probs (a page shows neither), the oldest dropped first. Holding whole episodes
    made a server grow by ~4 MB per request."""

    def __init__(self, count: int = 1000, max_bytes: int = 64 << 20):
        self.count, self.max_bytes, self.nbytes = count, max_bytes, 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, tid: str, ep: Episode) -> None:
        lean = {"generations": {"__all__": {"prompt_ids", "completion_ids", "logprobs"}}}
        blob = zlib.compress(ep.model_dump_json(exclude=lean).encode(), 6)
        with self._lock:
            self._items[tid] = blob
            self.nbytes += len(blob)
            while self._items and (len(self._items) > self.count or self.nbytes > self.max_bytes):
                self.nbytes -= len(self._items.popitem(last=False)[1])

    def get(self, tid: str) -> Episode | None:
        with self._lock:
            blob = self._items.get(tid)
        return None if blob is None else Episode.model_validate_json(zlib.decompress(blob))

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class AnswerTally:
    """How many answers the server sent since it started, and how many of them were not in the exact form for their
    task (`m1.answer_ok: false`), for `/health`: a team whose answers stop parsing shows up there and in the log,
    not only in the scores a client computes later. Each such answer is one warning naming its request."""

    def __init__(self):
        self.answered = self.not_in_form = 0
        self._lock = threading.Lock()

    def add(self, reply: ChatCompletionResponse, task: str) -> None:
        with self._lock:
            self.answered += 1
            self.not_in_form += not reply.m1.answer_ok
        if not reply.m1.answer_ok:
            got = repr(reply.m1.answer[:60]) if reply.m1.answer else "no answer (null or empty)"
            log.warning("the answer to request %s (task %s, reply %s) is not in the exact form for its task: %s; "
                        "sent with m1.answer_ok false", reply.m1.question_id, task, reply.id, got)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"answered": self.answered, "not_in_form": self.not_in_form}


def error_response(exc: ApiError):
    """The one JSON error a refused request gets: OpenAI's error body, the status and any headers (Retry-After)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@contextmanager
def storage_refusals():
    """Turn the server's own disk or file-table failures inside the block into the 5xx `server_storage_error` picks;
    any other OSError goes on as it is (an internal error)."""
    try:
        yield
    except OSError as exc:
        refused = server_storage_error(exc)
        if refused is None:
            raise
        raise refused from None


def check_key(request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (compared in constant time); no key, no check."""
    if api_key is None:
        return
    got = request.headers.get("authorization", "")
    token = got[7:] if got[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode("utf-8", "replace"), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")


async def read_body(request, max_bytes: int) -> Any:
    """The request's JSON body, read no further than `max_bytes` whatever Content-Length claimed (413 past it); 400
    for a body that is not JSON or that the client stopped sending half-way (one warning, no internal error)."""
    from starlette.requests import ClientDisconnect

    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise ApiError(413, f"body of {int(size)} bytes: at most {max_bytes}")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_bytes:
                raise ApiError(413, f"body over {max_bytes} bytes")
    except ClientDisconnect:  # the client hung up mid-body: nobody to answer, nothing went wrong here
        log.warning("client %s hung up after %d bytes of its body; request dropped",
                    request.client.host if request.client else "?", len(raw))
        raise ApiError(400, "the client disconnected before its body was complete") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise bad("the body is not valid JSON") from None


async def client_gone(request) -> None:
    """Return once the client has closed its connection. Only waiting on the connection tells the server of a
    hang-up, so this runs beside the request's work from the moment its body is read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_left(request, q: Question, started: bool) -> ApiError:
    """One log line naming a request whose client went away before its answer, and the error nobody will read.
    `started`: its batch was already running (it finishes; the answer is discarded)."""
    fate = "its batch runs on, the answer discarded" if started else "dropped before it ran"
    log.warning("client %s went away before the answer to request %s: %s",
                request.client.host if request.client else "?", q.id, fate)
    return ApiError(400, "the client disconnected before its answer")


async def await_episode(request, batcher: Batcher, job, timeout_s: float, gone: asyncio.Future) -> Episode:
    """The episode the batcher ran for `job`. Past `timeout_s` it is a 504, and a client that hangs up first is
    `client_left`: either way the job is cancelled, so work nobody waits for does not hold the worker. The
    server's disk or file table failing it (e.g. out of file handles opening the video) is a 5xx."""
    answer = asyncio.wrap_future(job.future)
    with storage_refusals():
        done, _ = await asyncio.wait({answer, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            return answer.result()
    answer.cancel()  # the batch skips a cancelled future when it resolves its requests
    dropped = batcher.cancel(job)
    if gone in done:
        raise client_left(request, job.question, started=not dropped)
    raise ApiError(504, f"no answer within {timeout_s:g} s (--timeout)", kind="timeout")


def refuse_failed(ep: Episode) -> None:
    """A 400 on `messages` for an episode that ended in an error: a prompt over a model's context or the prompt
    budget, or a video that could not be read; the upload's temp folder is not named."""
    if not ep.error:
        return
    msg = ep.error.replace(str(Path(ep.question.video).parent), "<upload>")
    if msg.startswith("prompt too long: "):  # over a model's context or the prompt budget: both counts
        raise bad(msg, "messages")
    raise bad(f"unreadable video: {msg}", "messages")


async def reply_for(request, body: dict, ep: Episode, team_name: str, traces: TraceStore,
                    tally: AnswerTally):
    """The chat-completions reply of an answered episode (`body`: the request, a JSON object by now), kept in
    `traces` under a fresh id that is also the reply's id and names its trace page, and counted in `tally`."""
    from fastapi.responses import JSONResponse

    tid = uuid.uuid4().hex
    await asyncio.get_running_loop().run_in_executor(None, traces.add, tid, ep)
    base = str(request.base_url).rstrip("/")
    reply = ChatCompletionResponse.from_episode(ep, team_name, f"{base}/traces/{tid}", ignored_fields(body),
                                                reply_id=tid)
    tally.add(reply, ep.question.task)
    return JSONResponse(reply.model_dump())


def admit(request, draining: bool, api_key: str | None) -> None:
    """Refuse a request before its body is read: 503 while the server drains for shutdown, 401 without the key."""
    if draining:
        raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
    check_key(request, api_key)


async def answer_chat(request, team_name: str, limits: Limits, batcher: Batcher, traces: TraceStore,
                      tally: AnswerTally, api_key: str | None, draining: bool):
    """One chat-completions request from admission to reply, each refusal one JSON error. The upload's temp folder
    is removed here until the batcher takes it over (it removes it once the episode ran). From the end of the body
    on, the connection is watched: a client gone before its answer is not queued, or is dropped from the queue."""
    tmp = gone = None
    try:
        admit(request, draining, api_key)
        body = await read_body(request, limits.max_body_bytes)
        gone = asyncio.ensure_future(client_gone(request))
        with storage_refusals():  # the upload's folder and the video written into it
            tmp = Path(tempfile.mkdtemp(prefix="m1-serve-"))
            q = await asyncio.get_running_loop().run_in_executor(None, parse_request, body, team_name, limits, tmp)
        if gone.done():
            raise client_left(request, q, started=False)
        job = batcher.submit(q, tmp)
        tmp = None
        ep = await await_episode(request, batcher, job, limits.timeout_s, gone)
        refuse_failed(ep)
        return await reply_for(request, body, ep, team_name, traces, tally)
    except ApiError as exc:
        return error_response(exc)
    finally:
        if gone is not None:
            gone.cancel()
        cleanup(tmp)


def add_error_handlers(app) -> None:
    """One JSON error for what FastAPI itself refuses (404, a malformed request) and for any fault of the server,
    which is logged in one line and never shown as a traceback."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return error_response(ApiError(exc.status_code, str(exc.detail), kind="not_found_error"
                                       if exc.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return error_response(bad("malformed request"))

    @app.exception_handler(Exception)
    async def _internal(request, exc):  # a fault of the server, never of the request: no traceback in the body
        log.error("internal error: %s: %s", type(exc).__name__, exc)
        return error_response(ApiError(500, "internal server error; see the server's log", kind="server_error"))


def create_app(team: Team, limits: Limits, api_key: str | None = None, traces_kept: int = 1000):
    """The FastAPI app serving `team`. `api_key`: the key clients must send as `Authorization: Bearer KEY`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse

    name = team.cfg.name
    state = {"draining": False}
    traces = TraceStore(traces_kept)
    batcher = Batcher(team, limits)
    tally = AnswerTally()

    @asynccontextmanager
    async def lifespan(app):
        yield
        state["draining"] = True
        await asyncio.get_running_loop().run_in_executor(None, batcher.drain, limits.timeout_s)

    app = FastAPI(title=f"m1 serve: {name}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher, app.state.traces, app.state.serve_state, app.state.tally = batcher, traces, state, tally
    add_error_handlers(app)

    def get(path: str):
        """A GET route that answers HEAD too (monitors and `curl -I` send it): FastAPI's `app.get` registers GET
        alone, and HEAD would be a 405."""
        return app.api_route(path, methods=["GET", "HEAD"])

    @get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request, api_key)
        except ApiError as exc:
            return error_response(exc)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "m1",
                                            "agents": [a.name for a in team.cfg.agents]}]}

    @get("/health")
    async def health():
        return {"status": "draining" if state["draining"] else "ok", "pending": batcher.pending, **tally.counts()}

    @get("/traces/{trace_id}")
    async def trace(trace_id: str):
        from m1.trace import render_html

        ep = await asyncio.get_running_loop().run_in_executor(None, traces.get, trace_id)
        if ep is None:
            return error_response(ApiError(404, f"no trace {trace_id!r} (the server keeps the last {traces_kept})",
                                           kind="not_found_error"))
        html = await asyncio.get_running_loop().run_in_executor(None, render_html, ep)
        return HTMLResponse(html)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer_chat(request, name, limits, batcher, traces, tally, api_key, state["draining"])

    return app
