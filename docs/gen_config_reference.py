"""The config reference page, written from the pydantic config models themselves.

Every key of a run (``trainer.config.schema.RunConfig`` and its sections: the model and data variants,
``parallel``, ``hardware``) with its type, default, allowed range and ``Field(description=...)``. The
docs site builds it at build time (``docs/hooks.py``), so it cannot go stale; to read it here:

    python docs/gen_config_reference.py > /tmp/config-reference.md
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script or as an mkdocs hook: the checkout's packages
    sys.path.insert(0, str(REPO))

from trainer.config.schema import DATA_SECTIONS, MODEL_SECTIONS, RunConfig  # noqa: E402

PAGE = "reference/config.md"
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}
_NAMES = {"PlacementSpec": "placement", "Any": "any"}  # Shard(d) / Replicate / Partial, written as text
_UNIONS = {"model": ("arch", MODEL_SECTIONS), "data": ("kind", DATA_SECTIONS)}

HEADER = """# Config reference

Every key of a run's config, generated from the pydantic models in `trainer/config/` and
`parallel/config.py` each time the site is built: the path you set on the command line
(`train.steps=50`) or in a REST job's `config`, its type, its default, the range it is checked
against and its description (the same text `python -m trainer --help` prints). A `model` or `data`
section takes the keys of the variant its `arch` / `kind` names (the groups `model=hf` and
`data=files` pick `arch: hf` and `kind: files`; `model=gpt_debug` and `gpt_small` are `arch: llama`);
`[i]` is an entry of a list, `[<glob>]` a key of a glob-keyed mapping.
"""


def type_name(annotation: object) -> str:
    """A short, readable type: ``int | null``, ``"none" | "auto"``, ``list[str]``, ``dict[str, float]``."""
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type):
        return _NAMES.get(annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def default_text(field: FieldInfo) -> str:
    """The default as a user writes it in YAML/JSON; ``required`` where there is none."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(value, default=str)


def bounds_text(field: FieldInfo) -> str:
    found = [f"{sign} {getattr(m, op)}" for m in field.metadata for op, sign in _BOUNDS.items()
             if getattr(m, op, None) is not None]
    return ", ".join(found)


def _sections_in(annotation: object) -> tuple[str, type[BaseModel]] | None:
    """("", Section), ("[i]", Section) or ("[<glob>]", Section) when the annotation holds one section."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for arg in typing.get_args(annotation) if union else (annotation,):
        origin, inner = typing.get_origin(arg), typing.get_args(arg)
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return "", arg
        if origin is list and inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            return "[i]", inner[0]
        if origin is dict and inner and isinstance(inner[1], type) and issubclass(inner[1], BaseModel):
            return "[<glob>]", inner[1]
    return None


def as_markdown(text: str) -> str:
    """``text`` shown as written: Markdown's characters escaped outside its `code spans` (a glob's ``*``,
    ``cuda:<id>``, ``[2,2,2]`` would otherwise become emphasis, an HTML tag, a link)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        plain = re.sub(r"([\\*_\[\]])", r"\\\1", parts[i])
        parts[i] = plain.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _entry(path: str, field: FieldInfo) -> str:
    kind, default = f"`{type_name(field.annotation)}`", f"default `{default_text(field)}`"
    if path in _UNIONS:  # a tagged union: the variant's sections follow, each under its own heading
        tag, variants = _UNIONS[path]
        kind = f"a section chosen by `{tag}`: " + ", ".join(f"`{v.model_fields[tag].default}`" for v in variants)
        default = f"default `{tag}: {getattr(field.get_default(call_default_factory=True), tag)}`"
    facts = [kind, default]
    if bounds := bounds_text(field):
        facts.append(bounds)
    description = as_markdown(" ".join((field.description or "").split()))
    return f"- **`{path}`** · {' · '.join(facts)}  \n  {description}"


def fields(model: type[BaseModel], prefix: str) -> list[tuple[str, FieldInfo]]:
    """Every (dotted path, field) under ``model``, sections depth-first; the model/data unions left out."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append((path, field))
        nested = _sections_in(field.annotation)
        if nested is not None and not (prefix == "" and name in _UNIONS):
            suffix, section = nested
            out += fields(section, f"{path}{suffix}.")
    return out


def walk() -> dict[str, tuple[str, list[tuple[str, FieldInfo]]]]:
    """The page's sections, in order: (title -> (its description, its keys)). The top-level keys
    first, then each section, each model variant and each data variant."""
    groups: dict[str, tuple[str, list[tuple[str, FieldInfo]]]] = {"top-level keys": ("", [])}
    for path, field in fields(RunConfig, ""):
        top = path.split(".")[0].split("[")[0]
        section = RunConfig.model_fields[top]
        if top in _UNIONS or _sections_in(section.annotation) is None:
            groups["top-level keys"][1].append((path, field))
        elif path != top:
            groups.setdefault(top, ((section.description or "").strip(), []))[1].append((path, field))
    for top, (tag, variants) in _UNIONS.items():
        for variant in variants:
            value = variant.model_fields[tag].default
            groups[f"`{top}` with `{tag}: {value}`"] = ((variant.__doc__ or "").strip() if variant.__doc__ else "",
                                        fields(variant, f"{top}."))
    return groups


def render() -> str:
    lines = [HEADER]
    for title, (description, entries) in walk().items():
        lines.append(f"## {title}\n" if " " in title else f"## `{title}`\n")  # "top-level keys", or a section
        if description:
            lines.append(as_markdown(" ".join(description.split())) + "\n")
        lines += [_entry(path, field) for path, field in entries]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
