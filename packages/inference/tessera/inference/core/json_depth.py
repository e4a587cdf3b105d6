"""JSON from clients, refused when it nests deeper than MAX_JSON_DEPTH levels.

Python's json module recurses once per level and raises RecursionError (a 500, and a traceback)
somewhere near 1,000 levels, depending on how deep the caller's own stack already is; a 200 KB
`[[[...]]]` reaches that. pydantic-core's parser (jiter, already a dependency through pydantic)
stops at a fixed 200 levels with a ValueError instead, so it is the probe here: text it refuses
for depth is refused; text it refuses for another reason (a lone surrogate escape, which the json
module accepts) is parsed once more by the json module, whose RecursionError then counts as too
deep. Request bodies are probed by the server's guard before any handler parses them; client text
that is parsed later (a tool call's `arguments`, a `guided_json` given as a string) goes through
`loads`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json

MAX_JSON_DEPTH = 200  # jiter's fixed limit (pydantic-core)


class JsonTooDeep(ValueError):
    """JSON text nested deeper than MAX_JSON_DEPTH."""


def depth_problem(text: str | bytes) -> str | None:
    """Why this JSON text nests too deeply to be parsed, or None (also for text that is no JSON at
    all: the caller's parser says what is wrong with it)."""
    try:
        from_json(text)
        return None
    except ValueError as exc:
        if "recursion limit" in str(exc):
            return f"nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        json.loads(text)
    except RecursionError:
        return f"nests deeper than {MAX_JSON_DEPTH} levels"
    except ValueError:
        pass
    return None


def loads(text: str | bytes) -> Any:
    """json.loads, raising JsonTooDeep (a ValueError, not a JSONDecodeError) for text nested
    deeper than MAX_JSON_DEPTH."""
    problem = depth_problem(text)
    if problem is not None:
        raise JsonTooDeep(problem)
    return json.loads(text)
