"""How the command line ends on a user's mistake: one actionable line on stderr and a non-zero status, never a
traceback (edgeswarm.cli.main's ``main`` is the one place that applies this to every command)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from pydantic import ValidationError
from rich.markup import escape

from edgeswarm.cli.console import err_console
from edgeswarm.errors import ConfigError, DuplicateNodeError, EdgeswarmError

# The hub URL comes from --hub as often as from the environment: a bad one names both.
_FLAG_OF = {"hub_url": "--hub / EDGESWARM_HUB_URL"}
_SECRET_HINTS = ("password", "secret", "key")
_VALUE_IN_MESSAGE = {"hub_url", "data_url"}  # their validator quotes the URL, credentials removed
_MAX_SHOWN = 60

# Exit status of a command whose reader went away (`edgeswarm watch | head`), as for a process killed by SIGPIPE.
BROKEN_PIPE_STATUS = 141


def exit_status(run: Callable[[], int]) -> int:
    """``run()``'s exit status, a user's mistake reported as one ``error:`` line: 3 for a node name already online,
    2 for a configuration mistake, 1 for any other edgeswarm error, 130 for an interrupt."""
    try:
        return run()
    except DuplicateNodeError as exc:
        report(str(exc))
        return 3
    except ConfigError as exc:
        report(str(exc))
        return 2
    except EdgeswarmError as exc:
        report(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130


def report(message: str) -> None:
    """Print ``message`` as one ``error:`` line on stderr: not wrapped, and never read as rich markup (a message
    may hold ``pip install 'edgeswarm[plot]'`` or text from the network)."""
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)


def settings_problem(exc: ValidationError) -> str:
    """The invalid ``EDGESWARM_*`` settings of ``exc`` (a Settings validation error) in one line: each variable,
    the value given (never a secret's) and what it expects."""
    problems = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = [str(p) for p in err["loc"]]
        if not loc:  # a check across fields: its message names the variables itself
            problems.append(msg)
            continue
        field = loc[0]
        name = _FLAG_OF.get(field, f"EDGESWARM_{field.upper()}")
        where = f" (at {'.'.join(loc[1:])})" if len(loc) > 1 else ""
        value = err.get("input")
        shown = ""
        secret = any(h in field for h in _SECRET_HINTS)
        if isinstance(value, (str, int, float)) and not secret and field not in _VALUE_IN_MESSAGE:
            text = str(value)
            shown = f"={text[:_MAX_SHOWN]!r}" + ("..." if len(text) > _MAX_SHOWN else "")
        problems.append(f"{name}{shown}{where}: {msg}")
    return "invalid settings: " + "; ".join(problems)


def detach_stdout() -> None:
    """Point stdout at /dev/null after its reader went away, so the interpreter's last flush at exit cannot fail
    again with an "Exception ignored ... BrokenPipeError" message."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout to redirect (captured or closed): nothing will flush to it
        pass
