"""The two checks every typed config's validation uses: a condition that raises
:class:`~triton_backend.core.errors.ConfigError` with a short message, and "a real int, not a bool"."""

from __future__ import annotations

from triton_backend.core.errors import ConfigError


def config_check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message if len(message) <= 300 else message[:297] + "...")  # a huge value, echoed: cut


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["config_check", "is_int"]
