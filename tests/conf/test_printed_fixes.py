"""Fixes that fix: every override a printed fix names runs as printed, and removes its issue.

The catalogue is every bad config of ``test_bad_configs.py`` plus :data:`MORE` below (refusals
no case there reaches). For each, every issue the validator reports is taken as the user reads
it: the overrides in its fix (``key=value`` words, a quoted one split as a POSIX shell splits
it) are applied after the config's own overrides, and the config validated again. The issue
must be gone, and no new one come; the config may still fail, only for another issue it had. Overrides written next to
each other are one fix; overrides with words between them are alternatives, each tried alone.

A second test walks every ``ConfigIssue(...)`` written in ``parallel/`` and ``trainer/`` (AST):
each must be raised by some catalogue config, or be listed in :data:`PROSE` with the reason
its fix names no override; so a new refusal cannot slip in untested.

Run: ``python -m pytest tests/conf/test_printed_fixes.py -q``
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

import pytest
from fix_catalogue import HOST, MORE, PROSE, SLOW
from test_bad_configs import CASES, Bad, compose
from test_stage_configs import CASES as STAGE_CASES

from parallel.errors import ConfigError, ConfigIssue
from tests.docs_text import command_line
from trainer.__main__ import FIRST_LINE
from trainer.planner.auto.plan import resolve_and_validate
from trainer.validate import model_checks
from trainer.launch.disk_checks import launch_disk_issues

REPO = Path(__file__).resolve().parents[2]
CATALOGUE: dict[str, Bad] = {**CASES, **{f"stages/{name}": case for name, case in STAGE_CASES.items()}, **MORE}
_WORD = re.compile(r"'[^']*'\S*|\S+")
_OVERRIDE = re.compile(r"[+~]{0,2}[A-Za-z_]\w*(\.\w+)*=.*")
_RAISED: dict[tuple[str, int], str] = {}  # ConfigIssue call site (file, line) -> a catalogue case raising it


def fix_groups(fix: str) -> list[list[str]]:
    """The overrides of a printed fix, as shell words: each group is one fix (overrides written
    next to each other), the groups are alternatives."""
    groups: list[list[str]] = []
    adjacent, exported = False, False
    for word in _WORD.findall(fix):
        if exported:  # `export CXX=clang++`: the shell's environment, not an override
            adjacent = exported = False
            continue
        exported = word == "export"
        word = word.lstrip("(")
        while word.endswith((",", ";", ".")) or (word.endswith(")") and word.count(")") > word.count("(")):
            word = word[:-1]
        tokens = shlex.split(word) if "=" in word and word.count("'") % 2 == 0 else []
        if len(tokens) == 1 and _OVERRIDE.fullmatch(tokens[0]):
            if not adjacent:
                groups.append([])
            groups[-1].append(tokens[0])
            adjacent = True
        else:
            adjacent = False
    return groups


@pytest.fixture(autouse=True)
def _own_directory(tmp_path, monkeypatch):
    """Each case in a directory of its own: the launcher's disk checks read the working directory (a
    ``checkpoints/`` left in the checkout by an earlier run would be another run's checkpoints)."""
    monkeypatch.chdir(tmp_path)


def test_fix_groups_reads_a_fix_as_a_shell_would():
    fix = ("use a tp size dividing 2, or replicate them: 'parallel.placements={\"layers.*.w[qkv].weight\": {tp: "
           "Replicate}}' (or set parallel.pipeline.schedule=1F1B parallel.pipeline.stages_per_rank=1, or "
           "train.compile=false).")
    assert fix_groups(fix) == [['parallel.placements={"layers.*.w[qkv].weight": {tp: Replicate}}'],
                               ["parallel.pipeline.schedule=1F1B", "parallel.pipeline.stages_per_rank=1"],
                               ["train.compile=false"]]
    assert fix_groups("give node 0's address, e.g. launch.rdzv_endpoint=10.0.0.1:29500, the same") == [
        ["launch.rdzv_endpoint=10.0.0.1:29500"]]


def _issues(case: Bad, fix: list[str] = (), *, memory: bool = True) -> list[ConfigIssue]:
    """The issues of ``case`` with ``fix`` applied; ``memory`` false: without the memory prediction
    (half a second, and a refusal of its own: one a fix may leave, as any other reason). A fix that
    chooses a config group's option is typed in place of the override choosing that group (Hydra
    takes a group once); a refusal while composing is an issue as the validator's are."""
    try:
        raw = compose(*_in_place(case.overrides, fix))
        if case.edit is not None:
            case.edit(raw)
            _overlay(raw, fix)  # the edit may set the very key the fix sets: the user's fix comes last
        with patch.object(model_checks, "_check_memory", model_checks._check_memory if memory else lambda *_: []):
            cfg = resolve_and_validate(raw)[0]  # as the CLI does: +parallel=auto resolved, then validated
    except ConfigError as err:
        return err.issues
    return launch_disk_issues(cfg)  # then what the launcher checks on this host's disk before it starts


def _in_place(overrides: tuple[str, ...], fix: list[str]) -> list[str]:
    """``overrides`` then ``fix``, a fix choosing a config group replacing the override that chose it."""
    chosen = {_group(o) for o in fix if _is_group(o)}
    return [*(o for o in overrides if not (_is_group(o) and _group(o) in chosen)), *fix]


def _group(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def _overlay(raw: dict, fix: list[str]) -> None:
    """Apply ``fix``'s value overrides to an edited dict as Hydra would (group overrides were composed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from trainer.config.compose import CONF_DIR, forgiving_overrides

    cfg = OmegaConf.create(raw)
    for text in forgiving_overrides(list(fix)):
        parsed = OverridesParser.create().parse_override(text)
        if parsed.key_or_group in {p.name for p in CONF_DIR.iterdir() if p.is_dir()}:
            continue  # a config group: composed already
        OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), merge=True, force_add=True)
    raw.clear()
    raw.update(OmegaConf.to_container(cfg))


def _is_group(override: str) -> bool:
    from trainer.config.compose import CONF_DIR

    return override.lstrip("+~").partition("=")[0] in {p.name for p in CONF_DIR.iterdir() if p.is_dir()}


def _same(a: ConfigIssue, b: ConfigIssue) -> bool:
    """The same issue, whatever numbers it quotes (a fix may change them)."""
    return a.path == b.path and re.sub(r"\d+", "#", a.reason) == re.sub(r"\d+", "#", b.reason)


@pytest.fixture
def record_sites(monkeypatch) -> Iterator[list[tuple[str, int]]]:
    """Every ConfigIssue constructed meanwhile, as its call site (path relative to the repo, line)."""
    sites: list[tuple[str, int]] = []
    init = ConfigIssue.__init__

    def recording_init(self, *args, **kwargs):
        frame = sys._getframe(1)
        sites.append((frame.f_code.co_filename, frame.f_lineno))
        init(self, *args, **kwargs)

    monkeypatch.setattr(ConfigIssue, "__init__", recording_init)
    yield sites


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_every_printed_fix_fixes(name: str, record_sites):
    _assert_fixes_fix(name, CATALOGUE[name], record_sites)


@pytest.mark.parametrize("name", list(HOST))
def test_every_printed_fix_fixes_on_another_host(name: str, record_sites, monkeypatch):
    """Refusals of the host (no C++ compiler, no glibc): what the validator reads of it patched."""
    case, host = HOST[name]
    monkeypatch.delenv("CXX", raising=False)
    for target, value in host.items():
        if target == "CXX":
            monkeypatch.setenv(target, value)
        else:
            monkeypatch.setattr(target, value)
    _assert_fixes_fix(name, case, record_sites)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_every_printed_fix_fixes_slowly(name: str, record_sites):
    """Fixes whose config then runs the auto-planner (it calibrates this host first: minutes)."""
    _assert_fixes_fix(name, CATALOGUE[name], record_sites, apply=True)


def _assert_fixes_fix(name: str, case: Bad, record_sites: list[tuple[str, int]], *, apply: bool | None = None) -> None:
    issues = _issues(case)
    assert any(i.path == case.path for i in issues), f"{name}: no issue at {case.path}: {issues}"
    for site in record_sites:
        _RAISED.setdefault(site, name)
    if not (name not in SLOW if apply is None else apply):
        return  # recorded; the fixes are applied by the slow test
    failures = []
    for issue in issues:
        for group in fix_groups(issue.fix):
            if case.edit is not None and any(_is_group(o) for o in group):
                continue  # the edit wrote what no override can; a preset chosen under it is not the user's fix
            after = _issues(case, group, memory=issue.path == "launch.memory_budget_gb")
            if any(_same(issue, later) for later in after):
                failures.append(f"{issue}\n    applying {group} leaves it: {[str(i) for i in after]}")
            # ... and brings no problem of its own: typed as printed, the fix must not be refused
            # for something the config did not have (e.g. an axis the fix leaves to no role).
            # (An example path under /data/ stands for the user's own files: typed, it names none.)
            new = [str(i) for i in after if not any(_same(i, before) for before in issues)]
            if new and not any("=[/data/" in override for override in group):
                failures.append(f"{issue}\n    applying {group} brings new problems: {new}")
    assert not failures, "\n".join(failures)


def _call_sites() -> dict[tuple[str, int], tuple[str, str]]:
    """Every ``ConfigIssue(...)`` in parallel/ and trainer/: (file, line) -> (its source, its fix's source)."""
    sites = {}
    for root in ("parallel", "trainer"):
        for path in sorted((REPO / root).rglob("*.py")):
            source = path.read_text()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ConfigIssue" and node.args:
                    fix = ast.get_source_segment(source, node.args[-1])
                    sites[(str(path), node.lineno)] = (ast.get_source_segment(source, node), fix)
    return sites


def test_every_refusal_is_in_the_catalogue_or_prose():
    """Runs after the catalogue (pytest keeps file order): each call site was raised by a catalogue
    config, or its fix is prose, listed with the reason in :data:`PROSE` (keyed by a phrase of its source)."""
    if len(_RAISED) < 20:
        pytest.skip("run with the catalogue (the whole file), which records the sites it raises")
    sites = _call_sites()
    prose_used = {phrase: 0 for phrase in PROSE}
    missing = []
    named = []
    for (file, line), (source, fix) in sites.items():
        phrases = [p for p in PROSE if p in source and file.endswith(PROSE[p][0])]
        for p in phrases:
            prose_used[p] += 1
        if (file, line) in _RAISED:
            continue
        where = f"{Path(file).relative_to(REPO)}:{line}: {source[:160]}"
        if not phrases:
            missing.append(where)
        elif _OVERRIDE.search(fix):
            named.append(where)
    assert not missing, "refusals neither raised by a catalogue config nor listed as prose:\n" + "\n".join(missing)
    assert not named, "fixes that name an override must be tried by a catalogue config:\n" + "\n".join(named)
    stale = [p for p, n in prose_used.items() if n == 0]
    assert not stale, f"PROSE entries matching no ConfigIssue call: {stale}"


def test_independent_issues_come_in_one_round():
    """A batch that does not split and heads that do not divide over tp: both at once, not the
    batch first and the heads after it is fixed (issue 30)."""
    issues = _issues(MORE["more/batch-and-heads-in-one-round"])
    paths = {i.path for i in issues}
    assert "train.global_batch_size" in paths
    assert 'parallel.tensor_parallel.plan[megatron]["layers.*.attn.w[qkv].weight"].tp' in paths


def test_the_printed_fixes_run_on_the_command_line(tmp_path):
    """The refusal docs/bad-configs.md shows, fixed by typing its printed fixes into a shell exactly as
    printed (each a quoted glob key): the named plan's issues are withdrawn where the fixes re-place it."""
    from tests.conftest import run_cli

    refused = run_cli(["+parallel=tp", "mesh=[8]", "validate_only=true"], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith(f"{FIRST_LINE}\ninvalid config: 4 problems"), refused.stderr
    printed = [line.rpartition("or Replicate: ")[2].removesuffix(")") for line in refused.stderr.splitlines()[2:]]
    typed = " ".join(printed)  # the command line, as a user pastes the four fixes after it
    assert all(p.startswith("'parallel.placements={") for p in printed) and len(printed) == 4, refused.stderr
    fixed = run_cli(["+parallel=tp", "mesh=[8]", "validate_only=true", *shlex.split(typed)], cwd=tmp_path)
    assert fixed.returncode == 0 and fixed.stdout.startswith("config OK"), fixed.stderr


def test_the_documented_placement_command_validates():
    """docs/bad-configs.md's command with quoted glob keys and a bare ``Shard(1)``, as a shell splits it."""
    line = command_line("python -m trainer +parallel=tp mesh=[4] 'parallel.placements=", "bad-configs.md")
    cfg, _, _ = resolve_and_validate(compose(*shlex.split(line)[3:]))
    assert cfg.parallel.placements["layers.*.mlp.w2.weight"]["tp"].kind == "shard"
    assert cfg.parallel.placements["layers.*.attn.w[qkv].weight"]["tp"].kind == "replicate"
