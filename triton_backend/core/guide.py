"""Structured output: the typed constraint a request may carry (``guided_decoding_guide_type`` +
``guided_decoding_guide``, tensorrtllm_backend's names and kinds).

A :class:`Guide` is data only; :mod:`triton_backend.core.grammar` compiles it for a tokenizer and
tracks a request's grammar state. The kinds:

- ``json``: any JSON object or array (the guide text is ignored, as in TensorRT-LLM);
- ``json_schema``: a JSON value valid for the schema in the guide text;
- ``regex``: text that matches the regular expression as a whole;
- ``ebnf_grammar``: text in the language of a context-free grammar (GBNF, the EBNF dialect of
  llama.cpp / XGrammar with a ``root`` rule, or Lark syntax with a ``start`` rule).

JSON is written in one canonical layout (no free whitespace, ``", "`` between items and ``": "``
after keys, as Python's ``json.dumps`` writes it): the layout is then part of the grammar, so
punctuation and keys are forced tokens a speculative round drafts for free. A schema's own
``"x-guidance"`` object overrides these settings (e.g. ``{"whitespace_flexible": true}``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from triton_backend.core.errors import InvalidRequestError

MAX_GUIDE_CHARS = 64 * 1024  # a guide longer than this is refused at once (grammar compilation cost)

# the compiler's settings for every JSON guide (see the module doc)
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_SCHEMA: dict[str, Any] = {"type": ["object", "array"]}


class GuideType(str, enum.Enum):
    """What ``guided_decoding_guide`` holds (tensorrtllm_backend's ``guided_decoding_guide_type``)."""

    JSON = "json"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF_GRAMMAR = "ebnf_grammar"

    @classmethod
    def parse(cls, value: "str | GuideType") -> "GuideType":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise InvalidRequestError(f"unknown guided_decoding_guide_type {value!r}; expected one of: {names}") from None


@dataclass(frozen=True)
class Guide:
    """A request's output constraint: ``type`` and the guide ``text`` (schema, regex or grammar;
    unused for ``json``). Checked for shape here; a schema, regex or grammar that does not
    compile is refused when the request starts (:func:`triton_backend.core.grammar.compile_guide`)."""

    type: GuideType
    text: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", GuideType.parse(self.type))
        if not isinstance(self.text, str):
            raise InvalidRequestError("guided_decoding_guide must be a string")
        if len(self.text) > MAX_GUIDE_CHARS:
            raise InvalidRequestError(f"guided_decoding_guide is longer than {MAX_GUIDE_CHARS} characters")
        if self.type is not GuideType.JSON and not self.text.strip():
            raise InvalidRequestError(f"guided_decoding_guide_type {self.type.value!r} needs a guided_decoding_guide")
        if self.type is GuideType.JSON_SCHEMA:
            self.schema()  # a schema that is not JSON is refused with the request

    @classmethod
    def from_inputs(cls, guide_type: str | None, guide: str | None) -> "Guide | None":
        """The guide of a request's two inputs (None when neither is set)."""
        if not guide_type:
            if guide:
                raise InvalidRequestError("guided_decoding_guide needs a guided_decoding_guide_type")
            return None
        return cls(GuideType.parse(guide_type), guide or "")

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a ``json`` or ``json_schema`` guide."""
        if self.type is GuideType.JSON:
            return dict(ANY_JSON_SCHEMA)
        try:
            schema = json.loads(self.text)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"guided_decoding_guide is not valid JSON: {e.msg} at position {e.pos}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be a JSON object (or true / false)")
        return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})


__all__ = ["ANY_JSON_SCHEMA", "Guide", "GuideType", "JSON_LAYOUT", "MAX_GUIDE_CHARS"]
