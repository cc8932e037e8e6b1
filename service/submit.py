"""Turn what a remote user sent into a validated :class:`RunConfig` that cannot escape the service.

Two ways in: Hydra overrides (``["+parallel=dp", "mesh=[2]"]``, composed exactly as the CLI
composes them) or a whole config document. Either way the result is checked here before any
process exists:

- overrides: no ``hydra*`` keys, no ``_target_``, no ``~`` / ``++`` / ``@package`` forms, no
  sweeps, no ``${...}`` interpolation, and a group may only be set to one of its presets in
  ``conf/``;
- the resolved config: no ``_target_`` key and no ``${`` anywhere; every path confined by the
  rule of :mod:`service.confine`; tracking forced to the service's MLflow store and pre-created
  run, launches single-host on loopback;
- then :func:`trainer.validate.checks.validate_config`, the same checks and messages as the CLI.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parallel.errors import ConfigError, ConfigIssue
from parallel.plan.spec import ParallelPlan
from service.confine import check_relative_glob, confine_glob, confine_path
from trainer.config.chat_data import TEMPLATES
from trainer.config.compose import CONF_DIR, compose_dict
from trainer.config.path_text import NUL_FIX, NUL_REASON
from trainer.config.schema import RunConfig
from trainer.launch.rendezvous import LOOPBACK_HOSTS
from trainer.planner.auto.plan import resolve_and_validate
from trainer.tracking.credentials import strip_credentials
from trainer.tracking.run_info import RESERVED_TAG_PREFIXES, is_reserved_tag

# Hydra's compose API keeps global state: one composition at a time per process.
_COMPOSE_LOCK = threading.Lock()


def config_groups() -> dict[str, set[str]]:
    """conf/'s groups and their presets: ``{"parallel": {"dp", "3d", ...}, ...}``."""
    return {d.name: {p.stem for p in d.glob("*.yaml")} for d in sorted(CONF_DIR.iterdir()) if d.is_dir()}


def check_overrides(overrides: list[str]) -> list[ConfigIssue]:
    """Everything wrong with ``overrides`` as a remote user's request, before Hydra sees them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    groups = config_groups()
    parser = OverridesParser.create()
    issues: list[ConfigIssue] = []
    for index, text in enumerate(overrides):
        where = f"overrides[{index}]"
        if "${" in text:
            issues.append(ConfigIssue(where, f"{text!r} uses ${{...}} interpolation", "write the literal value"))
            continue
        if "_target_" in text:
            issues.append(ConfigIssue(where, f"{text!r} names _target_; the service never instantiates sent classes",
                                      "choose a preset group (model=..., data=...) instead"))
            continue
        try:
            override = parser.parse_override(text)
        except HydraException as err:
            issues.append(ConfigIssue(where, f"{text!r} is not a valid override: {str(err).splitlines()[0]}",
                                      "write key=value, +group=preset or group=preset"))
            continue
        key = override.key_or_group
        path = key.replace("/", ".")
        if key.split(".")[0].split("/")[0].startswith("hydra"):
            issues.append(ConfigIssue(path, "hydra.* settings are owned by the service", "remove this override"))
        elif override.type in (OverrideType.DEL, OverrideType.FORCE_ADD):
            form = "~key" if override.type == OverrideType.DEL else "++key"
            issues.append(ConfigIssue(path, f"the {form} form is not accepted over REST", "use key=value or "
                                                                                          "+group=preset"))
        elif override.package is not None:
            issues.append(ConfigIssue(path, "@package overrides are not accepted over REST", "use key=value or "
                                                                                             "group=preset"))
        elif override.is_sweep_override():
            issues.append(ConfigIssue(path, "sweeps are not accepted; one job is one config", "give a single value"))
        elif "/" in key:
            issues.append(ConfigIssue(path, f"{key!r} is not a config group", "use one of the groups "
                                                                              f"{sorted(groups)}"))
        elif key in groups:
            value = override.value()
            if not isinstance(value, str) or value not in groups[key]:
                issues.append(ConfigIssue(path, f"{value!r} is not a preset of group {key!r}",
                                          f"use one of {sorted(groups[key])}"))
    return issues


def compose_overrides(overrides: list[str]) -> dict[str, Any]:
    """The resolved config for checked overrides, or :class:`ConfigError` with the composition's complaint."""
    if issues := check_overrides(overrides):
        raise ConfigError(issues)
    try:
        with _COMPOSE_LOCK:
            return compose_dict(list(overrides))
    except ConfigError:  # the composition's own refusal (a group chosen without +) names its fix
        raise
    except Exception as err:  # Hydra's composition errors (unknown key, bad type) become 422s
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError([ConfigIssue("overrides", message,
                                       "check the keys with `python -m trainer --help`")]) from None


def check_document(doc: Any, path: str = "") -> list[ConfigIssue]:
    """``_target_`` keys, interpolations, OmegaConf's ``???`` and NUL bytes anywhere in a config document
    (a NUL byte, in a path, would reach ``open`` before the schema's own check: ``PathText``)."""
    issues: list[ConfigIssue] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            sub = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                issues.append(ConfigIssue(repr(sub), f"the key {NUL_REASON}", "remove this key"))
            elif str(key) == "_target_" or "${" in str(key):
                issues.append(ConfigIssue(sub, "keys naming _target_ or ${...} are refused", "remove this key"))
            else:
                issues.extend(check_document(value, sub))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            issues.extend(check_document(value, f"{path}[{i}]"))
    elif isinstance(doc, str) and "\x00" in doc:
        issues.append(ConfigIssue(path or "<root>", NUL_REASON, NUL_FIX))
    elif isinstance(doc, str) and ("${" in doc or doc == "???"):
        issues.append(ConfigIssue(path or "<root>", f"{doc!r} is an interpolation or a missing-value marker",
                                  "write the literal value"))
    return issues


def _confine_key(section: dict, key: str, path: str, workspace: Path, workdir: Path, *, read_only_ok: bool,
                 keep_refused: bool = True) -> list[ConfigIssue]:
    """``section[key]`` replaced by its confined real path; when refused, kept as sent (or set to
    null) and the issue returned."""
    value = section.get(key)
    if not isinstance(value, str):
        return []
    resolved, issue = confine_path(value, path, workspace=workspace, workdir=workdir, read_only_ok=read_only_ok)
    section[key] = resolved if issue is None else value if keep_refused else None
    return [issue] if issue else []


def _confine_files(data: dict, workspace: Path, workdir: Path) -> list[ConfigIssue]:
    """data=files and data=chat over REST: every path and glob, the tokenizer (and a chat template file)
    by the rule; a data.cache_dir the user names is in the job's workdir, none given is the service's
    token cache shared by the jobs."""
    issues: list[ConfigIssue] = []
    for key in ("paths", "val_paths"):
        patterns = data.get(key)
        if not isinstance(patterns, list):
            continue
        for index, pattern in enumerate(patterns):
            if isinstance(pattern, str):
                resolved, issue = confine_glob(pattern, f"data.{key}[{index}]", workspace=workspace, workdir=workdir)
                patterns[index] = resolved if resolved is not None else pattern
                issues += [issue] if issue else []
    issues += _confine_key(data, "tokenizer", "data.tokenizer", workspace, workdir, read_only_ok=True)
    if data.get("kind") == "chat":  # no token cache; a template that is not a built-in name is a file
        if data.get("template") not in (None, *TEMPLATES):
            issues += _confine_key(data, "template", "data.template", workspace, workdir, read_only_ok=True)
        return issues
    shared_cache = str(workspace / ".cache" / "meshflow-tokens")
    if data.get("cache_dir", shared_cache) == shared_cache:  # absent, or read back from a job: the shared one
        data["cache_dir"] = shared_cache
    else:
        issues += _confine_key(data, "cache_dir", "data.cache_dir", workspace, workdir, read_only_ok=False)
    return issues


def without_credentials(config: dict[str, Any]) -> dict[str, Any]:
    """A stored config as the API shows it: its tracking URI without ``user:password@``. Configs are
    stored without credentials (:func:`confine`); this keeps the rule for rows written before that."""
    tracking = config.get("tracking")
    if not isinstance(tracking, dict) or not isinstance(tracking.get("tracking_uri"), str):
        return config
    return {**config, "tracking": {**tracking, "tracking_uri": strip_credentials(tracking["tracking_uri"])}}


def _reserved_tags(tracking: Any) -> list[ConfigIssue]:
    """A tenant's ``tracking.tags`` in the namespaces the service's own tags live in (the run's owner,
    job id, MLflow user): refused, so no job's run can claim another owner."""
    tags = tracking.get("tags") if isinstance(tracking, dict) else None
    return [ConfigIssue(f"tracking.tags.{key}", f"the tag namespaces {' and '.join(RESERVED_TAG_PREFIXES)} are "
                        "the service's (the run's owner, job id and MLflow user)",
                        f"remove the tag, or name it outside them, e.g. +tracking.tags.{key.rsplit('.', 1)[-1]}=...")
            for key in (tags if isinstance(tags, dict) else {}) if is_reserved_tag(str(key))]


MULTI_NODE_ENDPOINT = "127.0.0.1:29400"  # replaced per job by the executor (first node's address, a free port)


def confine(raw: dict[str, Any], *, workspace: Path, workdir: Path, tracking_uri: str,
            run_id: str | None, multi_node: bool = False,
            ui_url: str | None = None) -> tuple[dict[str, Any], list[ConfigIssue]]:
    """A copy of ``raw`` with every path confined (:mod:`service.confine`) and the service's values
    forced into tracking (its store, its MLflow UI: the job's printed link is the API's) and launch,
    and what was refused. ``multi_node``: the executor places ``launch.nnodes`` > 1 nodes itself
    (each node's rank and rendezvous endpoint are its business)."""
    import copy

    out = copy.deepcopy(raw)
    issues: list[ConfigIssue] = []
    tracking = out.setdefault("tracking", {})
    if isinstance(tracking, dict):
        # without its credentials: the job gets those in its environment (scheduler.launch_of), so no
        # job row, API reply, ConfigMap or Ray entrypoint holds them
        tracking["tracking_uri"] = strip_credentials(tracking_uri)
        tracking["run_id"] = run_id
        tracking["ui_url"] = strip_credentials(ui_url) if ui_url else None
    issues += _reserved_tags(tracking)
    train = out["train"] if isinstance(out.get("train"), dict) else {}
    # A refused init_from becomes null: the validator would otherwise ask the filesystem about it.
    issues += _confine_key(train, "init_from", "train.init_from", workspace, workdir, read_only_ok=True,
                           keep_refused=False)
    checkpoint = train.get("checkpoint")
    if isinstance(checkpoint, dict):
        issues += _confine_key(checkpoint, "dir", "train.checkpoint.dir", workspace, workdir, read_only_ok=False)
        if checkpoint.get("resume") not in ("none", "auto", None, ""):
            issues += _confine_key(checkpoint, "resume", "train.checkpoint.resume", workspace, workdir,
                                   read_only_ok=False)
        if "dir" not in checkpoint:
            checkpoint["dir"] = str(workdir / "checkpoints")
    data = out.get("data")
    if isinstance(data, dict):
        if data.get("root") != "stdlib":  # the Python standard library: a named source, not a path
            issues += _confine_key(data, "root", "data.root", workspace, workdir, read_only_ok=True)
        if isinstance(data.get("glob"), str) and (issue := check_relative_glob(data["glob"], "data.glob")):
            issues.append(issue)
        if data.get("kind") in ("files", "chat"):
            issues += _confine_files(data, workspace, workdir)
    model = out.get("model")
    if isinstance(model, dict) and model.get("arch") == "custom" and model.get("builder") is not None:
        issues.append(ConfigIssue("model.builder", "an import path over REST would run code the service was sent",
                                  "use model.name=<a model the operator installed under the meshflow.models "
                                  "entry points>"))
    if isinstance(model, dict) and model.get("arch") == "hf":
        issues += _confine_key(model, "path", "model.path", workspace, workdir, read_only_ok=True)
    launch = out.setdefault("launch", {})
    if isinstance(launch, dict):
        launch.setdefault("log_dir", "logs")  # the per-rank logs stay in the job's workdir
        issues += _confine_key(launch, "log_dir", "launch.log_dir", workspace, workdir, read_only_ok=False)
        if launch.get("nnodes", 1) != 1 and not multi_node:
            issues.append(ConfigIssue("launch.nnodes", "this service runs jobs on its own host only (executor: local)",
                                      "set launch.nnodes=1, or ask the operator for MESHFLOW_EXECUTOR=ray "
                                      "or kubernetes"))
        if launch.get("node_rank", 0) != 0:
            issues.append(ConfigIssue("launch.node_rank", "the service gives every node its rank",
                                      "leave launch.node_rank out"))
        host = str(launch.get("rdzv_endpoint", "127.0.0.1:0")).rsplit(":", 1)[0]
        if host not in LOOPBACK_HOSTS:
            issues.append(ConfigIssue("launch.rdzv_endpoint", f"{host!r} is not a loopback address",
                                      "use 127.0.0.1:0"))
        elif multi_node and launch.get("nnodes", 1) != 1:
            # The executor gives every node the first node's address and a port it picked there; this
            # stands in for it in the stored config (port 0 is refused for several nodes).
            launch["rdzv_endpoint"] = MULTI_NODE_ENDPOINT
    return out, issues


def resolve_config(*, overrides: list[str] | None, document: dict[str, Any] | None, workspace: Path,
                   workdir: Path, tracking_uri: str, run_id: str | None,
                   limit_raw: Callable[[dict[str, Any]], list[ConfigIssue]] | None = None,
                   multi_node: bool = False, ui_url: str | None = None) -> tuple[RunConfig, ParallelPlan]:
    """The validated, confined config of a submission and its parallel plan, or :class:`ConfigError`
    naming every problem. The only composition and validation a job's config ever gets.
    ``limit_raw`` may change the confined document (the service's memory limit) and refuse it."""
    if document is not None:
        raw = document
    else:
        raw = compose_overrides(list(overrides or []))
    if issues := check_document(raw):
        raise ConfigError(issues)
    confined, issues = confine(raw, workspace=workspace, workdir=workdir, tracking_uri=tracking_uri, run_id=run_id,
                               multi_node=multi_node, ui_url=ui_url)
    if limit_raw is not None:
        issues += limit_raw(confined)
    try:
        # Nothing confinement refused is touched: the model checks would read the files a path
        # names, or import and call the builder a REST user sent.
        cfg, plan, _ = resolve_and_validate(confined, check_model=not issues)
    except ConfigError as err:
        raise ConfigError(issues + err.issues) from None
    if issues:
        raise ConfigError(issues)
    assert plan is not None, "a config without issues has a plan"
    return cfg, plan

