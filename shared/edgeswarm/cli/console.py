"""Rich consoles for the command line, wide enough for the tables even when output is piped."""

from rich.console import Console


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit on its own (status 1); raising lets edgeswarm.cli.main end every command alike, whether
        # it printed through rich or print(), when its reader goes away (`edgeswarm watch | head`).
        self.quiet = True
        raise BrokenPipeError("the reader of this command's output went away")


_width = max(Console().width, 150)
console = _Console(width=_width)
err_console = _Console(stderr=True, width=_width)
