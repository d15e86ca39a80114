"""One exception type for every bad-input case, so the CLI can print a single line and exit non-zero."""
from __future__ import annotations

import re

#: what ``str.splitlines`` breaks a line at, and the other C0 controls: never printed raw in a one-line message
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def one_line(name: str) -> str:
    """``name`` (a file or tensor name) with its control characters written as Python escapes (a newline as
    ``\\n``), so a message naming it stays on one line; every other character, non-ASCII included, is kept."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], name)


class GGUFModelError(Exception):
    """A GGUF model that cannot be used as it is.

    ``str(err)`` is one line of the form ``FILE: TENSOR: what is wrong`` (file and tensor are
    omitted when unknown; a control character in either is escaped: :func:`one_line`), which is what the CLI prints.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file, self.tensor, self.reason = file, tensor, message
        parts = [one_line(str(p)) for p in (file, tensor) if p]
        super().__init__(": ".join([*parts, " ".join(message.split())]))
