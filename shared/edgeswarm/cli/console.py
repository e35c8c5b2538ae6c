"""Rich consoles for the command line, wide enough for the tables even when output is piped."""

from rich.console import Console

_width = max(Console().width, 150)
console = Console(width=_width)
err_console = Console(stderr=True, width=_width)
