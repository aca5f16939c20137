"""kvcore's log lines follow the convention for libraries: nothing is written unless the program
configures logging.

kvcore logs with structlog under `kvcore.*` names. Unless the program configured structlog
itself (kvcore's CLI does: JSON lines on stderr), `install` routes those loggers to the standard
library's `logging`, whose `kvcore` logger has a NullHandler: an embedding program that
configures nothing sees nothing, `logging.basicConfig(level="INFO")` shows them, and a program
that configures structlog decides for them as for its own. Loggers of other names keep
structlog's defaults.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog


class _Route:
    """structlog's logger factory: the stdlib logger for `kvcore.*`, else structlog's default."""

    def __init__(self) -> None:
        self._default = structlog.PrintLoggerFactory()

    def __call__(self, *args: Any) -> Any:
        name = args[0] if args and isinstance(args[0], str) else ""
        if name == "kvcore" or name.startswith("kvcore."):
            return logging.getLogger(name)
        return self._default(*args)


def install() -> None:
    """Route kvcore's loggers to `logging` (once, and only where structlog is unconfigured)."""
    if structlog.is_configured():
        return
    logging.getLogger("kvcore").addHandler(logging.NullHandler())
    *chain, console = structlog.get_config()["processors"]

    def render(logger: Any, method_name: str, event_dict: Any) -> Any:
        if isinstance(logger, logging.Logger):  # the event itself, for the program's handlers
            return structlog.stdlib.ProcessorFormatter.wrap_for_formatter(
                logger, method_name, event_dict)
        return console(logger, method_name, event_dict)

    structlog.configure(processors=[*chain, render], logger_factory=_Route())


install()  # on import: before kvcore's first log line
