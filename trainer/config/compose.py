"""Compose a run config from ``conf/`` with Hydra overrides: the CLI's and the control plane's one way in.

Hydra lives at the edge: the composed ``DictConfig`` becomes a plain dict here, and nothing
below sees a ``DictConfig``. The values Hydra starts from are not written in YAML: they are
the pydantic models' own defaults (:mod:`trainer.config.schema`), registered in Hydra's ConfigStore
by :func:`register_defaults`, so ``python -m trainer --cfg job`` prints exactly what a REST
document without that section gets. ``conf/`` ships inside the package (``trainer/conf``;
the top-level ``conf`` is a link to it), so an installed wheel finds it too.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, cast

from parallel.errors import ConfigError, ConfigIssue
from trainer.config.schema import DATA_SECTIONS, MODEL_SECTIONS, RunConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # trainer/conf, shipped inside the package
BASE_CONFIG = "meshflow_defaults"


def register_defaults() -> None:
    """Store the models' defaults as Hydra configs: ``meshflow_defaults`` (every section except
    the tagged unions) and one ``<kind>_defaults`` per member of ``model`` and ``data``, which the
    presets in ``conf/model`` and ``conf/data`` extend. Idempotent."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    base = RunConfig().model_dump(mode="json")
    for union in ("model", "data"):  # a preset names its member; merging two members would mix their keys
        base.pop(union)
    store.store(name=BASE_CONFIG, node=base)
    for model in MODEL_SECTIONS:
        store.store(group="model", name=f"{model().arch}_defaults", node=model().model_dump(mode="json"))
    for data in DATA_SECTIONS:
        store.store(group="data", name=f"{data().kind}_defaults", node=data().model_dump(mode="json"))


_VALUE_KEY = re.compile(r"[A-Za-z_]\w*(\.\w+)*")


def forgiving_overrides(overrides: list[str]) -> list[str]:
    """``key=value`` overrides as Hydra's force-add (``++key=value``): a key a preset does not state
    (``parallel.activation_checkpointing`` after ``+parallel=fsdp``) is set like any other, and a
    misspelt one (``train.step``) reaches validation, which names it with the key it resembles,
    instead of Hydra's struct error. Config groups (``model=hf``), ``+``, ``~`` and ``hydra``
    overrides, sweeps (``optim.lr=1e-3,3e-3``: a sweeper reads them as written), flags and
    anything that is not a plain dotted key stay as written."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    out = []
    for override in overrides:
        override = _readable_by_hydra(override, parser)
        key, eq, _ = override.partition("=")
        plain = bool(eq and not override.startswith(("-", "+", "~")) and _VALUE_KEY.fullmatch(key)
                     and key not in groups and key.split(".")[0] != "hydra")
        if plain:
            try:
                plain = not parser.parse_override(override).is_sweep_override()
            except HydraException:  # Hydra reports the bad override itself, as written
                plain = False
        out.append(f"++{override}" if plain else override)
    return out


_QUOTED = re.compile(r""""(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'""")
_PLACEMENT_CALL = re.compile(r"\b(?:Shard|Partial|Replicate)\([^()]*\)")
_HYDRA_SPECIAL = re.compile(r"([\\()\[\]{}:=, \t])")  # what Hydra's grammar escapes in an unquoted key


def _readable_by_hydra(override: str, parser: Any) -> str:
    """``override`` in a form Hydra's grammar reads, for two it refuses: a mapping's quoted keys
    (``'parallel.placements={"layers.*.attn.w[qkv].weight": {tp: Shard(0)}}'``: Hydra reads only
    unquoted keys, with ``[`` and ``]`` escaped) become escaped unquoted keys, and a bare placement
    (``Shard(0)``, to Hydra a call of an unknown function) a quoted string. An override Hydra reads
    as written, or still refuses after that, stays as written (Hydra reports it as the user wrote it)."""
    from hydra.errors import HydraException

    key, eq, value = override.partition("=")
    if not eq or not any(c in value for c in "{\"'(") or key.lstrip("+~").split(".")[0] == "hydra":
        return override
    try:
        parser.parse_override(override)
        return override
    except HydraException:
        pass
    out, pos = [], 0
    for quoted in _QUOTED.finditer(value):
        out.append(_quote_placements(value[pos:quoted.start()]))
        is_key = "".join(out).rstrip().endswith(("{", ",")) and value[quoted.end():].lstrip().startswith(":")
        out.append(_HYDRA_SPECIAL.sub(r"\\\1", quoted.group()[1:-1]) if is_key else quoted.group())
        pos = quoted.end()
    out.append(_quote_placements(value[pos:]))
    readable = f"{key}={''.join(out)}"
    try:
        parser.parse_override(readable)
        return readable
    except HydraException:
        return override


def _quote_placements(text: str) -> str:
    return _PLACEMENT_CALL.sub(lambda call: f'"{call.group()}"', text)


def group_option_issues(overrides: list[str] | tuple[str, ...]) -> list[ConfigIssue]:
    """The overrides that choose a config group's option Hydra would refuse with its search-path dump:
    an option ``conf/<group>/`` lacks (``model=gpt_mo``), a group the defaults list lacks chosen
    without ``+`` (``parallel=fsdp``) or one it holds chosen with it (``+model=gpt_moe``). Each is
    reported as an unknown key is: the group, the option it resembles and the override to type."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    register_defaults()  # the pydantic defaults' own options (model=gpt_defaults) are options too
    parser, issues, elsewhere = OverridesParser.create(), [], _search_dirs(list(overrides))
    for text in overrides:
        if text.startswith("-") or "=" not in text:
            continue
        try:
            override = parser.parse_override(text)
        except HydraException:  # Hydra reports the bad override itself, as written
            continue
        group = override.key_or_group
        if override.package is not None or override.is_delete() or not (CONF_DIR / group).is_dir():
            continue
        values = list(override.sweep_string_iterator()) if override.is_choice_sweep() else [override.value()]
        chosen = [option for option in values if isinstance(option, str)]
        if elsewhere is None or len(chosen) != len(values):
            continue  # a search path entry this cannot list (pkg://): Hydra looks the options up itself
        presets, theirs = _yaml_options([CONF_DIR], group), _yaml_options(elsewhere, group)
        stored = ConfigStore.instance().list(group) if group in ConfigStore.instance().list("") else []
        known = {*presets, *theirs, *(name.removesuffix(".yaml") for name in stored)}
        listed = group in _default_groups()
        plus = "++" if override.is_force_add() else "" if listed else "+"
        if all(option in known for option in chosen) and (override.is_force_add() or override.is_add() != listed):
            continue
        meant = [option if option in known else next(iter(difflib.get_close_matches(option, presets + theirs, n=1)),
                                                     None)
                 for option in chosen]
        issues.append(ConfigIssue(group, *_group_option_problem(text, group, chosen, meant, presets, theirs, plus)))
    return issues


def _yaml_options(folders: list[Path], group: str) -> list[str]:
    return sorted({p.stem for folder in folders for p in (folder / group).glob("*.yaml")})


def _search_dirs(argv: list[str]) -> list[Path] | None:
    """The folders Hydra searches for configs beyond trainer/conf: ``hydra.searchpath``'s and
    ``--config-dir``'s; None when an entry is not a folder (``pkg://``), whose options are not listed here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # start-up: with Hydra, at the edge

    entries: list[str] = []
    for index, text in enumerate(argv):
        if text.lstrip("+").startswith("hydra.searchpath="):
            value = OverridesParser.create().parse_override(text).value()
            entries += [str(entry) for entry in (value if isinstance(value, list) else [value])]
        elif text in ("--config-dir", "-cd") and index + 1 < len(argv):
            entries.append(argv[index + 1])
        elif text.startswith("--config-dir="):
            entries.append(text.partition("=")[2])
    if any("://" in entry and not entry.startswith("file://") for entry in entries):
        return None
    return [Path(entry.removeprefix("file://")) for entry in entries]


def _group_option_problem(typed: str, group: str, chosen: list[str], meant: list[str | None], presets: list[str],
                          theirs: list[str], plus: str) -> tuple[str, str]:
    """The reason and the fix of :func:`group_option_issues` for the override ``typed``."""
    unknown = [option for option, guess in zip(chosen, meant) if guess != option]
    if unknown:
        reason, how = f"unknown option {', '.join(map(repr, unknown))} of config group {group}", ""
    elif plus:
        reason, how = f"{typed} overrides a group the defaults list does not choose", "append it with +: "
    else:
        reason, how = f"{typed} appends a group the defaults list already chooses", "override it without +: "
    options = f"options in trainer/conf/{group}: {', '.join(presets)}"
    if theirs:
        options += f"; on the search path: {', '.join(theirs)}"
    if None in meant:
        appended = {"+": ", appended with +", "++": ", forced with ++"}.get(plus, "")
        return reason, f"choose one of the {options.replace(':', appended + ':', 1)}"
    guesses = [guess for guess in meant if guess is not None]  # all of them: each option is known or has a guess
    mean = f"did you mean {', '.join(g for g, o in zip(guesses, chosen) if g != o)}? " if unknown else ""
    return reason, f"{mean}{how}write {plus}{group}={','.join(guesses)}; {options}"


def _default_groups() -> set[str]:
    """The config groups conf/config.yaml's defaults list chooses (``model``, ``data``, ...)."""
    import yaml  # start-up: Hydra's own dependency, read only when overrides name a group

    entries = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    return {key for entry in entries if isinstance(entry, dict) for key in entry if " " not in key and "/" not in key}


def check_group_options(overrides: list[str] | tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` for :func:`group_option_issues`; nothing when there are none."""
    if issues := group_option_issues(overrides):
        raise ConfigError(issues)


def compose_dict(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The resolved config for ``overrides`` (as typed after ``python -m trainer``), as a plain dict,
    with the preset it came from in ``tracking.tags.preset`` as the CLI has it; a config group's
    unknown option is a :class:`ConfigError` (:func:`group_option_issues`)."""
    from hydra import compose, initialize_config_dir

    check_group_options(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="meshflow"):
        cfg = compose(config_name="config", overrides=forgiving_overrides(list(overrides)), return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    return with_preset(to_plain(cfg), choices)


def with_preset(raw: dict[str, Any], choices: Any) -> dict[str, Any]:
    """``raw`` with ``tracking.tags.preset`` set (unless given) to the config group it was composed
    from: the seed example, else the parallel preset, else ``single`` (one device)."""
    preset = next((str(choices[g]) for g in ("examples", "parallel") if choices.get(g)), "single")
    tracking = raw.setdefault("tracking", {})
    if isinstance(tracking, dict):
        tags = tracking.get("tags")
        if tags is None or isinstance(tags, dict):
            tracking["tags"] = {"preset": preset, **(tags or {})}
    return raw


def to_plain(cfg: Any) -> dict[str, Any]:
    """A composed DictConfig as a plain dict without Hydra's own `hydra` node."""
    from omegaconf import OmegaConf, open_dict

    if "hydra" in cfg:  # Hydra's own node resolves only inside a running Hydra app: drop it first
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a composed config: names to values
