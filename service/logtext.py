"""Client-supplied text bound for a log line: cut to a length, control characters escaped."""

from __future__ import annotations

import re

MAX_LOGGED_CHARS = 200  # of one client-supplied field in a log line
# C0 and C1 controls, DEL, and the line and paragraph separators (line breaks to some readers)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def log_text(value: str | None, limit: int = MAX_LOGGED_CHARS) -> str | None:
    """`value` cut to `limit` characters with a marker saying how many were left out, every
    control character written as its escape (`\\n`, `\\x1b`, `\\u2028`): a log line holds
    neither a client's megabytes nor a forged line break or terminal sequence."""
    if value is None:
        return None
    text = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"),
                        value[:limit])
    if len(value) > limit:
        text += f"...[{len(value) - limit} more chars]"
    return text
