"""One exception type for every bad-input case, so the CLI can print a single line and exit non-zero."""
from __future__ import annotations


class GGUFModelError(Exception):
    """A GGUF model that cannot be used as it is.

    ``str(err)`` is one line of the form ``FILE: TENSOR: what is wrong`` (file and tensor are
    omitted when unknown), which is what the CLI prints.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file, self.tensor, self.reason = file, tensor, message
        parts = [p for p in (file, tensor) if p]
        super().__init__(": ".join([*parts, " ".join(message.split())]))
