"""pydantic's validation errors as :class:`~parallel.errors.ConfigIssue` s: the first layer of
:func:`trainer.validate.checks.validate_config`.

    try:
        RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(schema_issues(err, raw))

Each issue names the config path as the user wrote it (without pydantic's union tags), the reason
in words, and a fix: the allowed values, the expected type, or the keys known at that place.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from parallel.errors import ConfigIssue, format_path
from trainer.config.path_text import NUL_FIX, NUL_REASON
from trainer.config.schema import RunConfig

_UNION_TAGS = {"model": "arch", "data": "kind"}


def schema_issues(err: ValidationError, raw: dict) -> list[ConfigIssue]:
    issues = []
    for e in err.errors(include_url=False):
        loc = _strip_union_tags(e["loc"], raw)
        reason = _reason(e)
        if loc and loc[-1] == "[key]":  # pydantic marks a bad mapping key with a `[key]` segment
            loc, reason = loc[:-1], f"bad key: {reason}"
        if e["type"] in ("union_tag_invalid", "union_tag_not_found") and loc and loc[0] in _UNION_TAGS:
            loc = (*loc, _UNION_TAGS[loc[0]])  # the user wrote the tag wrong: point at `model.arch`
        path = format_path(*loc) if loc else "<root>"
        issues.append(ConfigIssue(path, reason, _fix(e, loc, raw)))
    return issues


def _strip_union_tags(loc: tuple, raw: dict) -> tuple:
    """Pydantic puts the union tag into the location (``model.llama.dim``); users never write it."""
    out = list(loc)
    if len(out) > 1 and out[0] in _UNION_TAGS and isinstance(raw.get(out[0]), dict):
        if raw[out[0]].get(_UNION_TAGS[out[0]]) == out[1]:
            del out[1]
    # Union members of plain types add their type name (`mesh.list[int]`): keep the user's path.
    return tuple(p for p in out if not (isinstance(p, str) and ("[" in p and p.endswith("]") and "list" in p)))


def _reason(e: ErrorDetails) -> str:
    value = e.get("input")
    shown = repr(value) if not isinstance(value, dict) and len(repr(value)) < 80 else "the given value"
    if e["type"] == "extra_forbidden":
        return "unknown key"
    if e["type"] == "missing":
        return "required key is missing"
    if e["type"] == "union_tag_invalid":  # the input is the whole section; show the tag the user wrote
        ctx = e.get("ctx") or {}
        return f"unknown value {ctx.get('tag')!r}; known: {ctx.get('expected_tags')}"
    if e["type"] == "union_tag_not_found":
        return "required key is missing: it selects which kind of section this is"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{msg}; got {shown}"


def _fix(e: ErrorDetails, loc: tuple, raw: dict) -> str:
    kind = e["type"]
    if kind == "extra_forbidden":
        known = _known_keys(loc[:-1], raw)
        if not known:
            return "remove it"
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        mean = f"did you mean {format_path(*loc[:-1], close[0])}? " if close else ""
        return f"{mean}remove it or fix the spelling; known keys here: {', '.join(known)}"
    if kind == "missing":
        return "add it"
    if kind in ("literal_error", "union_tag_invalid", "enum"):
        return "use one of the listed values"
    if kind in ("union_tag_not_found",):
        return "add the tag key (model.arch or data.kind), or pick a preset such as model=gpt_debug"
    if kind.startswith(("greater", "less")):
        return _range_fix(e, loc)
    if kind == "value_error":
        return NUL_FIX if e["msg"].endswith(NUL_REASON) else "write a valid value as the message says"
    if kind in ("bool_parsing", "bool_type") and loc and all(isinstance(p, str) and p.isidentifier() for p in loc):
        return f"use true or false: {'.'.join(loc)}=true or {'.'.join(loc)}=false"
    return "give a value of the expected type"


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _range_fix(e: ErrorDetails, loc: tuple) -> str:
    """``use a value in the allowed range (<= 1000): train.checkpoint.keep=1000``: the nearest allowed
    value as an override, typed as printed; without one (a float's open bound, a path no override
    spells) the bound alone."""
    ctx = e.get("ctx") or {}
    op = next((k for k in _BOUNDS if k in ctx), None)
    if op is None:
        return "use a value in the allowed range"
    bound = ctx[op]
    value = e.get("input")
    nearest = bound
    if op in ("gt", "lt"):  # an open bound: the nearest whole number inside it, for an integer field
        nearest = bound + 1 if op == "gt" else bound - 1
        if not (isinstance(value, int) and isinstance(bound, int)):
            nearest = None
    text = f"use a value in the allowed range ({_BOUNDS[op]} {_number(bound)})"
    if nearest is None or not loc or not all(isinstance(p, str) and p.isidentifier() for p in loc):
        return text
    return f"{text}: {'.'.join(loc)}={_number(nearest)}"


def _number(value: Any) -> str:
    """``1000``, ``86400``, ``0.5``: as an override takes it (no ``1e+09``, no ``1000.0``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _known_keys(loc: tuple, raw: dict) -> list[str]:
    """Field names of the model section at ``loc`` (best effort, for the fix text)."""
    model: type[BaseModel] | None = RunConfig
    node: Any = raw
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        node = node.get(part) if isinstance(node, dict) else None
        annotation = model.model_fields[part].annotation
        model = _section_model(annotation, node)
        if model is not None and _is_mapping_of_sections(annotation) and parts:
            key = parts.pop(0)  # `layouts["<glob>"]`: the user's key, then the section's fields
            node = node.get(key) if isinstance(node, dict) else None
    return sorted(model.model_fields) if model else []


def _is_mapping_of_sections(annotation: Any) -> bool:
    import typing

    return any(typing.get_origin(a) is dict for a in (annotation, *typing.get_args(annotation)))


def _section_model(annotation: Any, node: Any) -> type[BaseModel] | None:
    import typing

    candidates = [a for a in typing.get_args(annotation) or (annotation,)]
    flat: list[Any] = []
    for c in candidates:
        flat.extend(typing.get_args(c) or (c,))
    models = [c for c in flat if isinstance(c, type) and issubclass(c, BaseModel)]
    for m in models:  # a tagged union: pick the member the user's tag names
        for tag in ("arch", "kind"):
            if isinstance(node, dict) and tag in m.model_fields and node.get(tag) == m.model_fields[tag].default:
                return m
    return models[0] if len(models) == 1 else None
