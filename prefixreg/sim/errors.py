"""The simulator's HTTP error: a status, a message and an optional code. Pure."""

from __future__ import annotations

__all__ = ["ApiError"]


class ApiError(Exception):
    """An HTTP error the simulator answers with the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
