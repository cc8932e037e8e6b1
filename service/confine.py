"""One rule for every path a job's config names, applied before anything reads the path.

A path a REST user sends is **relative**, has no ``..``, and resolves (``realpath``, so a
symlink cannot lead out) inside one of:

- the job's own workdir ``<workspace>/jobs/<job id>/`` — the only place a job writes
  (checkpoints, logs, caches it is given by name) and the base of any other relative path;
- a read-only area of the workspace, named by the path's first part: ``datasets/...`` is
  ``<workspace>/datasets/...`` and ``models/...`` is ``<workspace>/models/...``, which the operator
  fills (there is no upload endpoint). Jobs read from them and never write there.

So the job store (``meshflow.db*``), other jobs' directories, the token cache and the server's
own files are out of reach. A config read back from the API holds its paths resolved (absolute);
sent again, each is taken as the relative path it stands for (:func:`as_sent`): one under a job's
workdir names that place in the *new* job's workdir, one under ``datasets/`` or ``models/`` stays
there. No other absolute path is accepted. Each accepted path is stored resolved (absolute, real), so the job
opens exactly what was checked. Nothing here touches the filesystem but ``realpath`` and, for a
``data.paths`` glob whose literal prefix is already confined, the glob's matches.
"""

from __future__ import annotations

import glob as globlib
import os
from pathlib import Path, PurePosixPath

from parallel.errors import ConfigIssue

READ_ONLY_AREAS = ("datasets", "models")
RULE = ("give a relative path: inside the job's workdir (e.g. `checkpoints`), or under the workspace's "
        "read-only `datasets/...` or `models/...` areas")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _has_glob(part: str) -> bool:
    return any(c in part for c in "*?[")


def as_sent(value: str, *, workspace: Path, workdir: Path, read_only_ok: bool) -> str:
    """``value`` as the relative path it was sent as when it is a path this service stored (see
    the module docstring), else ``value`` unchanged. Lexical only: the result is then confined
    like any path a user sends (realpath and all), so nothing here reaches another job's files."""
    path = PurePosixPath(value)
    if not path.is_absolute() or ".." in path.parts:
        return value
    jobs_dir = workdir.parent  # a job's workdir is <jobs dir>/<job id>
    # (where such paths lie, what replaces that prefix): a job's files lose <jobs dir>/<job id>.
    roots = [(jobs_dir, None)] + ([(workspace / area, area) for area in READ_ONLY_AREAS] if read_only_ok else [])
    for root, area in roots:
        for base in dict.fromkeys((str(root), os.path.realpath(root))):  # as configured, and as realpath stored it
            if _inside(value, base) and value != base:
                rest = PurePosixPath(value).relative_to(base).parts
                relative = (area, *rest) if area else rest[1:]
                return str(PurePosixPath(*relative)) if relative else "."
    return value


def confine_path(value: str, key: str, *, workspace: Path, workdir: Path,
                 read_only_ok: bool) -> tuple[str | None, ConfigIssue | None]:
    """``(the real absolute path, None)`` when ``value`` obeys the rule, else ``(None, the issue)``.

    ``read_only_ok``: whether ``datasets/...`` and ``models/...`` may be named (inputs); outputs
    (checkpoints, logs, caches) stay in the workdir.
    """
    value = as_sent(value, workspace=workspace, workdir=workdir, read_only_ok=read_only_ok) if value else value
    parts = PurePosixPath(value).parts
    if not value or PurePosixPath(value).is_absolute() or value.startswith("~"):
        return None, ConfigIssue(key, f"{value!r} is an absolute path; it is outside the job's workdir and the "
                                      "workspace's read-only areas", RULE)
    if ".." in parts:
        return None, ConfigIssue(key, f"{value!r} uses `..`; it escapes the job's workdir", RULE)
    if read_only_ok and parts and parts[0] in READ_ONLY_AREAS:
        base, root, where = workspace, os.path.realpath(workspace / parts[0]), f"the workspace's {parts[0]}/ area"
    else:
        base, root, where = workdir, os.path.realpath(workdir), "the job's workdir"
    literal = parts[: next((i for i, p in enumerate(parts) if _has_glob(p)), len(parts))]
    resolved = os.path.realpath(base.joinpath(*literal))
    if not _inside(resolved, root):
        return None, ConfigIssue(key, f"{value!r} resolves outside {where} (a symbolic link leads out)", RULE)
    tail = parts[len(literal):]
    return (os.path.join(resolved, *tail) if tail else resolved), None


def confine_glob(pattern: str, key: str, *, workspace: Path, workdir: Path) -> tuple[str | None, ConfigIssue | None]:
    """A ``data.paths`` entry: the rule for its literal prefix, and every match stays where the prefix is."""
    pattern = as_sent(pattern, workspace=workspace, workdir=workdir, read_only_ok=True)
    resolved, issue = confine_path(pattern, key, workspace=workspace, workdir=workdir, read_only_ok=True)
    if issue or resolved is None or not any(_has_glob(p) for p in PurePosixPath(pattern).parts):
        return resolved, issue
    parts = PurePosixPath(pattern).parts
    area = parts[0] if parts and parts[0] in READ_ONLY_AREAS else None
    root = os.path.realpath(workspace / area) if area else os.path.realpath(workdir)
    # The prefix is confined, so listing below it reads only allowed places; a symlink below it may still lead out.
    if any(not _inside(os.path.realpath(m), root) for m in globlib.glob(resolved, recursive=True)):
        return None, ConfigIssue(key, f"{pattern!r} matches a file outside its area through a symbolic link", RULE)
    return resolved, None


def check_relative_glob(glob: str, key: str) -> ConfigIssue | None:
    """A glob applied below an already confined directory (``data.glob``): relative, no ``..``."""
    parts = PurePosixPath(glob).parts
    if PurePosixPath(glob).is_absolute() or ".." in parts or glob.startswith("~"):
        return ConfigIssue(key, f"{glob!r} reaches outside data.root",
                           "use a relative glob without `..`, e.g. `**/*.txt`")
    return None
