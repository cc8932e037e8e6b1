"""``python -m trainer --help``: every config key with its description, default and range, from the pydantic models."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from trainer.config.compose import CONF_DIR
from trainer.config.schema import DATA_SECTIONS, MODEL_SECTIONS, RunConfig

USAGE = """usage: python -m trainer [key=value ...] [+parallel=PRESET] [+recipe=RECIPE] [group=option ...] [--cfg job]

Compose a run from conf/ (Hydra), validate it against the model, then train.
  python -m trainer                               one device, default model (gpt_debug) on stdlib text
  python -m trainer +parallel=3d mesh=[2,2,2]     8 workers: dp x pp x tp
  python -m trainer validate_only=true ...        check the config and exit
  python -m trainer --cfg job                     print the resolved config
  python -m trainer model=hf model.path=DIR data=files 'data.paths=[corpus/*.jsonl]' data.tokenizer=DIR
                                                  your Hugging Face model and your documents
Beside it: python -m trainer.export CKPT [--format hf] (weights out), python -m trainer.generate CKPT --prompt TEXT.
"""


def _groups() -> str:
    lines = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        prefix = "+" if group.name in ("parallel", "examples", "recipe") else ""
        lines.append(f"  {prefix}{group.name}={{{','.join(options)}}}")
    return "\n".join(lines)


def _bounds(field: FieldInfo) -> str:
    """`` [>= 1, <= 1000]``: the range pydantic enforces on a number, as the refusal prints it."""
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = [f"{sign} {getattr(m, op)}" for m in field.metadata for op, sign in words.items()
             if getattr(m, op, None) is not None]
    return f" [{', '.join(found)}]" if found else ""


def _default(field: FieldInfo) -> str:
    """`` (default: 100)``: the value the key has when no override names it, as an override would spell it."""
    if field.is_required():  # a section's own required key (parallel.dims), or a section (model, data)
        return "" if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else " (required)"
    value = field.get_default(call_default_factory=True)
    return "" if isinstance(value, BaseModel) else f" (default: {_spelled(value)})"


def _spelled(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_spelled(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_spelled(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and (value == "" or value != value.strip()):
        return repr(value)
    return str(getattr(value, "value", value))


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    lines = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        args = typing.get_args(field.annotation) or (field.annotation,)
        items = [typing.get_args(a)[0] for a in args if typing.get_origin(a) is list and typing.get_args(a)]
        nested = [a for a in (*args, *items) if isinstance(a, type) and issubclass(a, BaseModel)]
        if items and nested:  # a list of sections (parallel.pipeline.stages): its entries' keys as [i].key
            lines.append(f"  {path}: {field.description}{_default(field)}{_bounds(field)}")
            lines += _fields(nested[0], f"{path}[i].")
        elif len(nested) == 1 and name not in ("model", "data"):
            lines.append(f"  {path}: {field.description}{_default(field)}{_bounds(field)}")
            lines += _fields(nested[0], f"{path}.")
        else:
            lines.append(f"  {path}: {field.description}{_default(field)}{_bounds(field)}")
    return lines


def print_help() -> None:
    print(USAGE)
    print("config groups:\n" + _groups() + "\n")
    print("keys:")
    print("\n".join(_fields(RunConfig)))
    sections = [(f"model (arch={m().arch})", m) for m in MODEL_SECTIONS]
    sections += [(f"data (kind={d().kind})", d) for d in DATA_SECTIONS]
    for title, model in sections:
        print(f"\n{title}:")
        print("\n".join(_fields(model, f"{title.split()[0]}.")))
