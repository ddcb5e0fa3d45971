"""`m1 serve` as a command (m1/serve/command.py): a port it cannot serve on ends it with one `error:` line and exit 2,
before any team loads (loading takes seconds, and uvicorn's own failure is exit 3, a code `m1` does not use)."""
import socket
from types import SimpleNamespace

import pytest

from tests.core.test_faults import invoke, one_error

pytest.importorskip("fastapi")  # the serve extra


@pytest.fixture
def loads(monkeypatch) -> list:
    """The team loader replaced by one that records its calls and fails the command (exit 1, not 2) when called."""
    import m1.config

    calls = []

    def load_team(name, overrides):
        calls.append(name)
        raise AssertionError("the team was loaded")

    monkeypatch.setattr(m1.config, "load_team", load_team)
    return calls


@pytest.fixture
def held():
    """A port another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_another_server_holds_is_one_error_line_before_the_team_loads(loads, held):
    r = invoke("serve", "--team", "mini_trained", "--port", held)
    one_error(r, f"cannot serve on 127.0.0.1:{held}", "Address already in use", "--port")
    assert loads == []


def test_a_port_taken_while_the_team_loads_is_exit_2_not_uvicorns_3(monkeypatch, held):
    """The check cannot see a port taken after it: uvicorn then fails to bind and exits 3; that too is exit 2 with
    one `error:` line."""
    import m1.config
    import m1.models.preflight
    import m1.serve.command
    import m1.team.engines_registry

    async def app(scope, receive, send):  # a server with nothing to serve, but a lifespan uvicorn can run
        while scope["type"] == "lifespan":
            kind = (await receive())["type"].rsplit(".", 1)[1]
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return

    monkeypatch.setattr(m1.serve.command, "check_port", lambda host, port: None, raising=False)  # free then
    monkeypatch.setattr(m1.config, "load_team", lambda name, overrides: SimpleNamespace(name=name))
    monkeypatch.setattr(m1.models.preflight, "startup_problems", lambda cfg: ([], []))
    monkeypatch.setattr(m1.team.engines_registry, "make_team", lambda cfg: cfg)
    monkeypatch.setattr(m1.serve.command, "create_app", lambda team, limits, api_key: app)
    r = invoke("serve", "--team", "mini_trained", "--port", held)
    one_error(r, f"cannot serve on 127.0.0.1:{held}", "did not start")
