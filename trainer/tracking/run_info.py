"""What a run tells MLflow about itself: a name, tags, readable params and its UI link; never a secret.

    name = run_name(cfg)                  # "3d-2x2x2" (preset and mesh), or tracking.run_name
    tags = run_tags(cfg)                  # mesh, dims, preset, world_size, model, precision, git_commit, user, host
    tracker.log_params(public_config(cfg.model_dump(mode="json")))   # never the tracking URI
    print(run_url(cfg.tracking.tracking_uri, experiment_id, run_id, cfg.tracking.ui_url))

``public_config`` is the one door to MLflow for the config: it drops the tracking URI and run id
(a database URL may carry a password), masks the password part of any URL, and blanks every
value whose key names a secret (token, password, api key, ...).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainer.config.model_schema import CustomModelConfig, HFModelConfig
from trainer.config.schema import RunConfig
from trainer.config.tracking_schema import DEFAULT_UI_URL
from trainer.tracking.credentials import strip_credentials

PRESET_TAG = "preset"
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
SWEEP_JOB_TAG = "sweep_job"  # the job's number in a --multirun (trainer.cli.main sets it)
# Tags whose namespace belongs to whoever runs the trainer: MLflow's own (`mlflow.user`, the source)
# and the control plane's (`meshflow.owner`, `meshflow.job_id`). A user's tracking.tags never replace them.
RESERVED_TAG_PREFIXES = ("meshflow.", "mlflow.")


def is_reserved_tag(key: str) -> bool:
    """Whether ``key`` lies in a namespace :data:`RESERVED_TAG_PREFIXES` keeps for the trainer and the service."""
    return key.lower().startswith(RESERVED_TAG_PREFIXES)
# The config keys never sent to MLflow: where it is (a URL that may hold credentials) and which run.
NOT_LOGGED = ("tracking.tracking_uri", "tracking.run_id")
# A key names a secret by one of its words (split at `_`, `-`, `.` and camelCase humps): `hf_token`,
# `apiKey`, `db.password`. Not a substring test: `num_tokens`, `eos_token`, `tokenizer`, `author`
# and `max_tokens_per_s` are a count, a piece of text, a path, a name and a rate, never a secret.
SECRET_WORDS = frozenset({"password", "passwords", "passwd", "pass", "pwd", "passphrase", "secret", "secrets", "token",
                          "tokens",
                          "apikey", "credential", "credentials", "auth", "authorization", "bearer", "cookie"})
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"),
                          ("client", "secret")})
# Words that make a "token" a unit of text (a count of them, a special one, its id) rather than a credential.
TEXT_TOKEN_WORDS = frozenset({"num", "n", "max", "min", "total", "count", "per", "seq", "eos", "bos", "pad", "unk",
                              "sep", "cls", "mask", "special", "id", "ids", "len", "length", "budget"})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.\-]*://)(?P<user>[^/@\s:]*)(:[^/@\s]*)?@", re.IGNORECASE)
MASK = "***"


def is_secret_key(key: str) -> bool:
    """Whether a config or tag key names a secret (see :data:`SECRET_WORDS`)."""
    words = [w.lower() for w in _WORD.findall(str(key))]
    if any(pair in SECRET_PAIRS for pair in zip(words, words[1:])):
        return True
    secret = [w for w in words if w in SECRET_WORDS]
    if not secret:
        return False
    # `num_tokens`, `eos_token`, `pad_token_id`: text tokens; a password word is a secret whatever surrounds it.
    return any(w not in ("token", "tokens") for w in secret) or not any(w in TEXT_TOKEN_WORDS for w in words)


def redact(text: str) -> str:
    """``postgresql://me:pw@db/x`` -> ``postgresql://***@db/x``: no URL's user or password survives."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{MASK}@", text)


def public_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A copy of the (JSON-dumped) config that may be shown anywhere: see the module docstring."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if path in NOT_LOGGED:
            continue
        if is_secret_key(str(key)) and value not in (None, "", {}, []):
            out[key] = MASK
        elif isinstance(value, Mapping):
            out[key] = public_config(value, prefix=f"{path}.")
        else:
            out[key] = _public_value(value)
    return out


def _public_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [_public_value(v) for v in value]
    return value


# ------------------------------------------------------------------------------- name and tags


def mesh_label(cfg: RunConfig) -> str:
    return "x".join(str(n) for n in cfg.mesh_shape)


def run_name(cfg: RunConfig) -> str:
    """``tracking.run_name``, else the preset and the mesh: ``3d-2x2x2``, ``single-1``."""
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    job = cfg.tracking.tags.get(SWEEP_JOB_TAG)  # a sweep's jobs would all have the same name
    return f"{cfg.tracking.tags.get(PRESET_TAG, 'custom')}-{mesh_label(cfg)}" + (f"-job{job}" if job else "")


def run_tags(cfg: RunConfig) -> dict[str, str]:
    """The tags that tell runs apart in MLflow's list, MLflow's own ``mlflow.*`` ones among them
    (user, git commit, source), and the user's ``tracking.tags``, which never replace a reserved one
    (:func:`is_reserved_tag`). In a run made for the job by someone else (``tracking.run_id``: the
    control plane, which set its owner's ``mlflow.user`` and ``meshflow.*`` tags) no reserved tag
    comes from the config, and the trainer leaves ``mlflow.user`` as its creator set it."""
    model: str = cfg.model.arch
    if isinstance(cfg.model, HFModelConfig) and cfg.model.path:
        model = f"{model}:{Path(cfg.model.path).name}"
    elif isinstance(cfg.model, CustomModelConfig) and cfg.model.builder:
        model = f"{model}:{cfg.model.builder}"
    tags = {
        "mesh": json.dumps(cfg.mesh if cfg.mesh is not None else list(cfg.mesh_shape)),
        "dims": json.dumps(list(cfg.parallel.dims) if cfg.parallel else []),
        PRESET_TAG: cfg.tracking.tags.get(PRESET_TAG, "custom"), "world_size": str(cfg.world_size),
        "model": model, "precision": cfg.train.precision, "data": cfg.data.kind,
        "user": _user(), "host": socket.gethostname(),
        "mlflow.user": _user(), "mlflow.source.name": "python -m trainer", "mlflow.source.type": "LOCAL",
    }
    if commit := git_commit():
        tags["git_commit"] = tags["mlflow.source.git.commit"] = commit
    if parent := os.environ.get("MESHFLOW_SWEEP_PARENT_RUN"):  # a sweep's job (trainer.cli.sweep)
        tags["mlflow.parentRunId"] = parent
    if cfg.tracking.run_id is not None:
        del tags["mlflow.user"]
    tags.update({key: MASK if is_secret_key(key) else redact(str(value)) for key, value in cfg.tracking.tags.items()
                 if not (is_reserved_tag(key) and (key in tags or cfg.tracking.run_id is not None))})
    return tags


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        return str(os.getuid())


@cache
def git_commit() -> str | None:
    """The commit of the code that trains (this package's checkout), with ``-dirty`` when it has
    uncommitted changes; None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


# ------------------------------------------------------------------------------------ UI link


def is_server(tracking_uri: str) -> bool:
    """Whether the store is an MLflow server (``http(s)://``), which is its own UI."""
    return tracking_uri.startswith(("http://", "https://"))


def ui_base(tracking_uri: str, ui_url: str | None = None) -> str:
    """The MLflow UI that shows ``tracking_uri``'s runs: ``ui_url`` (``tracking.ui_url``, the service's
    ``mlflow_ui_url``) when given, else the server itself, else where ``mlflow ui`` serves a local store
    (http://127.0.0.1:5000). Never with a user or password: a link carries none."""
    base = ui_url or (tracking_uri if is_server(tracking_uri) else DEFAULT_UI_URL)
    return strip_credentials(base).rstrip("/")


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None, ui_url: str | None = None) -> str | None:
    """The run's page on :func:`ui_base`, in the model-training view (None without both ids)."""
    if not (experiment_id and run_id):
        return None
    # MLflow 3.17's UI picks its view from `workflowType` in the URL, else the browser's remembered
    # choice (GenAI at first), whatever the experiment's mlflow.experimentKind tag says: a link says it.
    return f"{ui_base(tracking_uri, ui_url)}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def ui_command(tracking_uri: str, ui_url: str | None = None) -> str | None:
    """The command that serves a local store where its links point: ``mlflow ui --backend-store-uri
    <the store> --port <the link's port>`` (no ``--port`` when the link names none, e.g. a proxy's
    https URL), from any directory (a relative SQLite path is made absolute); None for a server,
    which is its own UI."""
    if is_server(tracking_uri):
        return None
    port = urlsplit(ui_base(tracking_uri, ui_url)).port
    store = shlex.quote(redact(_from_anywhere(tracking_uri)))
    return f"mlflow ui --backend-store-uri {store}" + (f" --port {port}" if port else "")


def _from_anywhere(tracking_uri: str) -> str:
    """``sqlite:///mlflow.db`` -> ``sqlite:////work/run/mlflow.db``: the store this process opens,
    named the same from every directory. Other URIs as they are."""
    path, sep, query = tracking_uri.removeprefix("sqlite:///").partition("?")
    if not tracking_uri.startswith("sqlite:///") or not path or path == ":memory:" or Path(path).is_absolute():
        return tracking_uri
    return f"sqlite:///{Path(path).absolute()}{sep}{query}"
