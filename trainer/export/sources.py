"""What an export may copy beside the weights: the files a user needs to use the model (tokenizer,
chat template, generation config, special-token maps), and none the checkpoint merely names.

A checkpoint is data, possibly from anywhere: its metadata naming ``data.tokenizer=/home/me/.ssh/id_rsa``
must not get that file read and written out as ``<out>/tokenizer.json``. So a tokenizer or template
the checkpoint names is copied only when it lies inside the checkpoint directory (symlinks resolved,
file by file) or inside the model's own directory (``model.path`` of a Hugging Face model, whose
files the export reads anyway, by their fixed names only); anything else the user names on the
command line (``--tokenizer``, ``--template``), and the refusal prints that flag.

    tokenizer = tokenizer_source(checkpoint, extra, model_dir, given=args.tokenizer)
    copy_model_files(tokenizer, out)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.errors import CheckpointError
from trainer.config.chat_data import TEMPLATES

# What a model directory carries that a user of the model needs, by the names transformers reads.
MODEL_DIR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
TEMPLATE_FILE = "chat_template.jinja"  # transformers reads it before tokenizer_config.json's chat_template


@dataclass(frozen=True)
class Source:
    """A directory (or one tokenizer file) to copy :data:`MODEL_DIR_FILES` from; ``root``: where every
    copied file must resolve to (None: the user named it, or it is the model's directory)."""

    path: Path
    root: Path | None = None

    def files(self) -> dict[str, Path]:
        """``{name in the export: file}``: a tokenizer file is written as tokenizer.json, beside the
        other files of its directory."""
        directory = self.path if self.path.is_dir() else self.path.parent
        found = {name: directory / name for name in MODEL_DIR_FILES if (directory / name).is_file()}
        if not self.path.is_dir():
            found["tokenizer.json"] = self.path
        if self.root is not None:
            outside = sorted(str(file) for file in found.values() if not file.resolve().is_relative_to(self.root))
            if outside:
                raise CheckpointError(f"{outside[0]!r} leads outside the checkpoint {str(self.root)!r} (a symlink)",
                                      fix=f"name the tokenizer yourself: --tokenizer {outside[0]}")
        return found


def confined(checkpoint: Path, named: str, model_dir: Path | None, *, what: str, flag: str) -> Source:
    """``named`` (a path the checkpoint's metadata holds) as a :class:`Source`, when it lies inside the
    checkpoint directory or the model's directory; :class:`CheckpointError` naming ``flag`` otherwise."""
    path = Path(named).expanduser()
    resolved, inside = path.resolve(), checkpoint.resolve()
    if resolved.is_relative_to(inside):
        return Source(path, root=inside)
    if model_dir is not None and resolved.is_relative_to(model_dir.resolve()):
        return Source(path)
    where = "the checkpoint and the model's directory" if model_dir is not None else "the checkpoint"
    raise CheckpointError(f"checkpoint {str(checkpoint)!r} names the {what} {named!r}, outside {where}; an export "
                          "copies no other file a checkpoint names",
                          fix=f"if that is yours, name it yourself: {flag} {named}")


def tokenizer_source(checkpoint: str | Path, extra: dict, model_dir: str | None, *,
                     given: str | None = None) -> Source | None:
    """Where the export's tokenizer files come from: ``given`` (``--tokenizer``), else the run's
    ``data.tokenizer`` (confined: :func:`confined`), else None (the model directory's own, if any)."""
    if given is not None:
        if not Path(given).exists():
            raise ValueError(f"--tokenizer: {given!r} does not exist (give a tokenizer.json or a directory "
                             "holding one)")
        return Source(Path(given))
    named = (extra.get("data_config") or {}).get("tokenizer")
    if not named or not Path(named).expanduser().exists():
        return None
    source = confined(Path(checkpoint), named, Path(model_dir) if model_dir else None, what="tokenizer",
                      flag="--tokenizer")
    source.files()  # a symlink leading out is refused before anything is written
    return source


def template_text(checkpoint: str | Path, extra: dict, model_dir: str | None, *,
                  given: str | None = None) -> str | None:
    """The chat template the run trained with, to ship as ``chat_template.jinja``: ``given``
    (``--template``: a built-in name or a file), else the run's ``data.template`` (a file confined
    like the tokenizer), else None (the tokenizer's own, copied with its files)."""
    named = given if given is not None else (extra.get("data_config") or {}).get("template")
    if named is None:
        return None
    if named in TEMPLATES:
        return TEMPLATES[named]
    if given is None:  # symlinks resolved: the file itself lies inside
        confined(Path(checkpoint), named, Path(model_dir) if model_dir else None, what="chat template",
                 flag="--template")
    if not Path(named).expanduser().is_file():
        raise ValueError(f"--template: {named!r} is neither a built-in template ({', '.join(TEMPLATES)}) nor a file")
    return Path(named).expanduser().read_text()


def copy_model_files(sources: list[Source | None], out: Path, *, template: str | None = None) -> list[str]:
    """Copy each source's :data:`MODEL_DIR_FILES` into ``out`` (a later source's file wins) and write
    ``template`` as ``chat_template.jinja``; the names written, sorted."""
    files: dict[str, Path] = {}
    for source in sources:
        files.update(source.files() if source is not None else {})
    for name, file in files.items():
        shutil.copyfile(file, out / name)
    if template is not None:
        (out / TEMPLATE_FILE).write_text(template)
    return sorted({*files, *([TEMPLATE_FILE] if template is not None else [])})
