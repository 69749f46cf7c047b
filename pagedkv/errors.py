"""InvalidParameter: a ValueError that names the parameter at fault as data.

Callers (the HTTP server's 400s with ``param``, a UI highlighting a field) need to know which input was
wrong; they read ``exc.param`` instead of parsing the message.
"""

from __future__ import annotations


class InvalidParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
