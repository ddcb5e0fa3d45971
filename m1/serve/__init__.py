"""`m1 serve`: a team behind an OpenAI-compatible chat endpoint, so that any client that speaks the chat API
(the `openai` package, lmms-eval's `openai` model, curl) can ask it questions about videos.

One concern per module:
- `protocol`: the request and reply bodies as pydantic models, the error body, and how a request becomes the
  Question the team answers (validated as `m1 infer` validates a line, `check_question`);
- `media`: the request's video as a readable file (local files only under the allowed roots);
- `batcher`: the one thread that owns the team and runs requests that arrive together as one batch;
- `app`: the FastAPI routes, the API key, body-size limits and errors; `command`: the CLI command;
- `limits`: what one server accepts.
"""

from m1.serve.app import create_app, parse_request
from m1.serve.batcher import Batcher
from m1.serve.command import serve, serve_command
from m1.serve.limits import Limits
from m1.serve.protocol import ApiError, ChatCompletionRequest, ChatCompletionResponse, split_options

__all__ = ["ApiError", "Batcher", "ChatCompletionRequest", "ChatCompletionResponse", "Limits", "create_app",
           "parse_request", "serve", "serve_command", "split_options"]
