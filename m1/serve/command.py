"""The `m1 serve` command (registered in m1/cli.py): check the port, load a team and serve it with uvicorn."""

import os
import signal
from pathlib import Path

import typer
from typer import Option as typer_option  # typer is a core dependency (the CLI's)

from m1.errors import fail, report_startup
from m1.serve.app import create_app
from m1.serve.limits import Limits


def address(host: str, port: int) -> str:
    """`host:port` as a client would write it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port(host: str, port: int) -> None:
    """Stop with one `error:` line (exit 2) unless `host:port` can be bound now. Loading a team takes seconds; a
    port another server holds is named before that, not found by uvicorn after it (which would exit 3)."""
    import errno
    import socket

    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as s:  # each address set up as asyncio's server binds it
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
    except OSError as exc:  # in use, not an address of this machine, a name that does not resolve, ...
        held = " (another server holds it? stop it, or pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        fail(f"cannot serve on {address(host, port)}: {exc.strerror or exc}{held}")


def serve(team_name: str, host: str, port: int, limits: Limits, api_key_env: str | None = None,
          overrides: list[str] | None = None) -> None:
    """Check the port, load the team, then serve it with uvicorn until SIGTERM/SIGINT (requests in flight are
    finished)."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from m1.config import load_team
    from m1.models.preflight import PreflightError, startup_problems
    from m1.team.engines_registry import make_team

    check_port(host, port)
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {api_key_env}: that variable is not set or empty")
    cfg = load_team(team_name, overrides or [])
    try:  # a wrong endpoint, key or model of a hosted team: said before the port opens, not at the first request
        report_startup(*startup_problems(cfg))
    except PreflightError as exc:
        fail(str(exc))
    app = create_app(make_team(cfg), limits, api_key)

    class Server(uvicorn.Server):
        received: list[int] = []

        def handle_exit(self, sig, frame):  # remember what stopped it: SIGINT exits 130 once drained
            self.received.append(sig)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                   timeout_graceful_shutdown=int(limits.timeout_s) + 5))
    try:
        server.run()  # once drained, uvicorn raises the signal it caught again: SIGTERM ends the process (143)
    except KeyboardInterrupt:  # ... and SIGINT comes back as KeyboardInterrupt
        pass
    except SystemExit as exc:  # uvicorn could not start after all (the port taken while the team loaded)
        if exc.code != STARTUP_FAILURE or server.started:
            raise
        fail(f"cannot serve on {address(host, port)}: the server did not start (its reason is logged above)")
    if signal.SIGINT in server.received:
        typer.secho("stopped by SIGINT: the requests in flight were answered", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130)


def exposure(host: str, port: int, limits: Limits, api_key_env: str | None) -> str | None:
    """What anyone who can reach the port gets when `m1 serve` binds `host` with no API key, or None when only this
    machine can connect (a loopback address) or a key is required."""
    import ipaddress
    import socket

    if api_key_env:
        return None
    try:
        if all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
               for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)):
            return None
    except (OSError, ValueError):
        pass  # a name that does not resolve here: uvicorn will say so; assume it is reachable
    roots = ", ".join(str(r) for r in limits.allowed_roots) or "none (--allowed-media-root not given)"
    return (f"--host {host} with no --api-key-env: anyone who can reach port {port} can ask the team questions "
            f"on this machine's CPU/GPU, about any video under the allowed media roots ({roots}) named by a "
            f"file:// URL, and see its frames as thumbnails on the trace pages")


def serve_command(
    team: str = typer_option("tiny", "--team", "-t", help="Team config: a YAML path or a name in configs/team/."),
    host: str = typer_option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer_option(8000, "--port", min=0, max=65535, help="Port to listen on."),
    allowed_media_root: list[Path] = typer_option(None, "--allowed-media-root",
                                                  help="A folder whose videos file:// URLs may name (repeat)."),
    api_key_env: str = typer_option(None, "--api-key-env", help="NAME of the variable holding the key clients "
                                    "must send (Authorization: Bearer KEY); default: no key."),
    max_queue: int = typer_option(64, "--max-queue", min=1, help="Requests waiting or running before 429."),
    timeout: float = typer_option(300.0, "--timeout", min=1.0, help="Seconds a request may take before 504."),
    max_body_mb: float = typer_option(64.0, "--max-body-mb", min=0.001, help="Largest request body (413 above)."),
    max_text_kb: float = typer_option(1024.0, "--max-text-kb", min=0.001,
                                      help="Longest question text with its options, in units of 1,024 "
                                      "characters (413 above; checked before any model tokenizes it)."),
    gather_ms: float = typer_option(50.0, "--gather-ms", min=0.0,
                                    help="How long the first request of a batch waits for others to join it."),
    overrides: list[str] = typer_option(None, "--set", "-s", help="Config override key.path=value (repeat)."),
    insecure: bool = typer_option(False, "--insecure", help="Serve on an address other than loopback without an "
                                  "API key (refused without this flag; a warning names what becomes reachable)."),
) -> None:
    """Serve a team on an OpenAI-compatible chat endpoint (POST /v1/chat/completions, GET /v1/models).

    Requests that arrive together run as one batch through the team. SIGTERM/SIGINT finish the requests in
    flight and refuse new ones, then exit 143/130. An address other than loopback without an API key is refused
    unless --insecure; a port that cannot be bound is exit 2 before the team loads. See docs/serving.md."""
    from m1.config_files import ConfigError

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        fail(f"m1 serve needs the serve extra ({exc.name} is missing): pip install -e '.[serve]'")
    roots = []
    for r in allowed_media_root or []:
        if not Path(r).is_dir():
            fail(f"--allowed-media-root {r}: not a folder")
        roots.append(Path(r).resolve())
    limits = Limits(allowed_roots=roots, max_body_bytes=int(max_body_mb * (1 << 20)), max_queue=max_queue,
                    timeout_s=timeout, gather_s=gather_ms / 1000, max_text_chars=int(max_text_kb * 1024))
    exposed = exposure(host, port, limits, api_key_env)
    if exposed and not insecure:
        fail(f"{exposed}. Set a key (--api-key-env VAR), serve on 127.0.0.1, or pass --insecure to accept this")
    if exposed:
        typer.secho(f"warning: {exposed} (--insecure)", fg=typer.colors.YELLOW, err=True)
    try:
        serve(team, host, port, limits, api_key_env, overrides)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
