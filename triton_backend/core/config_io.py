"""Reading and writing the typed configs (frozen dataclasses) as plain JSON/YAML data.

One reader for every config section: a mapping's keys must be the class's fields (an unknown
key is an error naming the known ones), a field whose type is itself a config class is read
from a nested mapping, and whatever the class's own checks reject comes back as the caller's
error type with a short message. :func:`setting` declares a field with its description;
:func:`descriptions` lists them (every field of a speculation config has one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any, Mapping, TypeVar, cast

from triton_backend.core.errors import ConfigError, SpecbuildError

C = TypeVar("C")


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its description (``doc``), read back by :func:`descriptions`."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def descriptions(cls: type) -> dict[str, str]:
    """Each field of the config class ``cls`` with its description ('' where it has none)."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _section_type(hint: Any) -> type | None:
    """The config class a field holds (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a) and isinstance(a, type)]
        return classes[0] if len(classes) == 1 else None
    return None


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def read_config(cls: type[C], data: Any, what: str, error: type[SpecbuildError] = ConfigError) -> C:
    """``cls`` built from the mapping ``data`` (named ``what`` in messages); an instance of
    ``cls`` passes through. Errors are raised as ``error``."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise error(f"{what} must be an object (a mapping), got {type(data).__name__}")
    fields = dataclasses.fields(cast(Any, cls))
    known = {f.name for f in fields}
    unknown = sorted(map(str, set(data) - known))
    if unknown:
        raise error(f"unknown {what} fields: {unknown}; known: {sorted(known)}")
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{what} needs {', '.join(missing)}")
    hints = _hints(cls)
    kwargs = dict(data)
    for name, value in data.items():
        section = _section_type(hints[name])
        if section is not None and value is not None:
            kwargs[name] = read_config(section, value, name, error)
    try:
        return cls(**kwargs)
    except SpecbuildError as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{what}: {exc}") from None
    except TypeError as exc:  # a wrong type reached the constructor
        raise error(f"invalid {what}: {exc}") from None


def to_plain(config: Any) -> dict[str, Any]:
    """A config (dataclass) as plain JSON data: nested sections as objects, enums as their values."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


__all__ = ["descriptions", "read_config", "setting", "to_plain"]
