"""Every ``python -m ...`` command in the README and the docs pages, as a reader types it on a fresh
clone (``tests.docs_text.documented_commands``). The default pass checks each trainer command the way
the CLI does before it starts anything (group options, Hydra's compose, validation against the model),
in a directory holding what the pages say to make first (``python -m trainer.tools.tiny_hf data/``, the
custom model's file); a command no test can run here is listed in :data:`NOT_RUN` with the words of
its page that say what it needs, and the test checks the page still says so. The slow pass
(``test_docs_runs.py``) runs the commands as written, in subprocesses.

    python -m pytest -q tests/e2e/test_docs_commands.py
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from parallel.errors import ConfigError
from tests.docs_text import REPO, blocks, documented_commands, read_docs

# page -> {command prefix: words of that page that say what the command needs}
NOT_RUN: dict[str, dict[str, str]] = {
    "docs/multi-host.md": {"python -m trainer +parallel=fsdp mesh=[4]": "# host 10.0.0.2"},
    "docs/control-plane.md": {"python -m api.client": "MESHFLOW_URL, MESHFLOW_TOKEN"},
    "docs/deploy.md": {"python -m api.client": "ray start --head", "MESHFLOW_EXECUTOR=ray": "ray start --head",
                       "MESHFLOW_EXECUTOR=slurm": "run on a host with Slurm's client commands"},
    "docs/slurm.md": {"python -m pytest": "installs Debian's `slurmctld`, `slurmd`, `munge`"},
    "README.md": {"python -m pytest": "Run the tests"},
    "docs/testing.md": {"python -m pytest": "pytest"},
}
# commands that read what an earlier command of their page left (a checkpoint, an export): the slow pass
# runs them after it (tests/e2e/test_docs_runs.py); here, that their page has the command they follow
READS_A_RUN = ("python -m trainer.export ", "python -m trainer.generate ", "python -m trainer train.init_from=",
               "python -m trainer +parallel=fsdp mesh=[4] train.checkpoint.resume=auto")
TRAINER = re.compile(r"^python -m trainer( |$)")
# documented refusals: the command, the refusal's words, and the words of its page's comment saying so
REFUSED = {"python -m trainer +parallel=tp mesh=[8] validate_only=true": ("model.n_heads=4 over tp size 8",
                                                                          "a bad layout: the path, the reason"),
           "python -m trainer validate_only=true +parallel=tp mesh=[8]": ("model.n_heads=4 over tp size 8",
                                                                          "refused, 4 heads over tp 8")}


def _not_run(page: str, command: str) -> str | None:
    for prefix, needs in NOT_RUN.get(page, {}).items():
        if command.startswith(prefix):
            return needs
    return None


def test_every_documented_command_is_checked_or_says_what_it_needs():
    """Each command is a trainer command this file validates, one that reads an earlier run, or one
    whose page names what it needs; and the pages name it still (a stale entry fails too)."""
    unplaced = []
    for page, command in documented_commands():
        needs = _not_run(page, command)
        if needs is not None:
            assert needs in (REPO / page).read_text(), (page, command, needs)
        elif not (TRAINER.match(command) or command.startswith(READS_A_RUN)
                  or command.startswith(("python -m trainer.calibrate", "python -m trainer.tools.tiny_hf",
                                         "MESHFLOW_TOKENS="))):
            unplaced.append((page, command))
    assert unplaced == []


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory) -> Path:
    return make_fresh_clone(tmp_path_factory.mktemp("clone"))


def make_fresh_clone(cwd: Path) -> Path:
    """``cwd`` with what the pages say to make before their commands: the tiny Hugging Face
    models and data (``python -m trainer.tools.tiny_hf data/``), the custom model's file
    (docs/models-and-data.md's ``my_models/net.py`` block) and planning.md's hardware file."""
    from trainer.tools.tiny_hf import main as tiny_hf

    assert tiny_hf([str(cwd / "data")]) == 0
    net = next(block for block in blocks(read_docs("models-and-data.md"), "python")
               if block[0].startswith("# my_models/net.py"))
    (cwd / "my_models").mkdir()
    (cwd / "my_models" / "net.py").write_text("\n".join(net) + "\n")
    hardware = cwd / "home" / "meshflow-hw" / "hardware"
    hardware.mkdir(parents=True)
    (hardware / "my_gpu.yaml").write_text((REPO / "trainer" / "conf" / "hardware" / "h100_sxm.yaml").read_text())
    return cwd


def _overrides(command: str, home: Path) -> list[str]:
    """The command's overrides as the shell hands them over (``$HOME`` expanded), a sweep's first job."""
    words = shlex.split(command.replace("$HOME", str(home)))[3:]
    if "--multirun" in words:
        words.remove("--multirun")
        words = [w.split(",")[0] if "=" in w and "," in w and "[" not in w else w for w in words]
    return words


def _validate(overrides: list[str]) -> str:
    """What the CLI does before it starts anything: '' when the config is valid, else its refusal."""
    from trainer.config.compose import compose_dict
    from trainer.planner.auto.plan import resolve_and_validate

    try:
        resolve_and_validate(compose_dict(overrides))
    except ConfigError as err:
        if "dry_run=true" in overrides and all(i.path in {"train.global_batch_size", "parallel.pipeline.microbatches"}
                                               for i in err.issues):
            return ""  # a dry run plans despite the batch arithmetic (trainer.cli.job._plan_despite_batch)
        return str(err)
    return ""


TRAINER_COMMANDS = sorted({command for page, command in documented_commands() if TRAINER.match(command)
                           and _not_run(page, command) is None and not command.startswith(READS_A_RUN)
                           and "--help" not in command
                           and "--cfg" not in command and "hydra/sweeper=optuna" not in command})


# the planner's search over a 512-device cluster: a minute of CPU, so in the slow pass (which also runs it as written)
SLOW_TO_PLAN = ("+parallel=auto mesh=[512]",)


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if any(w in c for w in SLOW_TO_PLAN)
                                     else c for c in TRAINER_COMMANDS])
def test_documented_trainer_command_is_valid(command, fresh_clone, monkeypatch):
    monkeypatch.chdir(fresh_clone)
    monkeypatch.syspath_prepend(str(fresh_clone))  # `python -m` puts the working directory first
    monkeypatch.setenv("HOME", str(fresh_clone / "home"))
    refusal = _validate(_overrides(command, fresh_clone / "home"))
    if command in REFUSED:
        words, said = REFUSED[command]
        assert words in refusal and said in read_docs(), (command, refusal)
    else:
        assert refusal == "", command


def test_pages_say_how_to_make_the_hf_models_they_use():
    """A page whose commands name ``data/...`` (the tiny models, corpus or chats) says how to make them."""
    for page, command in documented_commands():
        if "data/" in command and not command.startswith("python -m trainer.tools.tiny_hf"):
            assert "python -m trainer.tools.tiny_hf data/" in (REPO / page).read_text(), page
    assert all(not os.path.isabs(p) for p in re.findall(r"model\.path=(\S+)", read_docs()))


def _requirements(extra: str, project: dict) -> list[str]:
    """An extra's requirements, the extras it names (``meshflow[hf,...]``) expanded."""
    out = []
    for requirement in project["optional-dependencies"][extra]:
        if requirement.startswith(f"{project['name']}["):
            for inner in requirement.split("[", 1)[1].rstrip("]").split(","):
                out += _requirements(inner, project)
        else:
            out.append(requirement)
    return out


def test_readme_install_line_installs_what_its_commands_need():
    """The README's first command installs the project with the extras its next commands use: the export
    is a directory transformers loads, and tiny_hf (the pages' models) needs tokenizers."""
    import tomllib

    from tests.docs_text import readme_blocks

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    install = readme_blocks()[0][0].split("&&")[1].strip()
    extras = re.fullmatch(r'pip install -e "\.\[([\w,-]+)\]"', install)
    assert extras, install
    names = {re.split(r"[<>=\[ ]", r)[0] for extra in extras[1].split(",") for r in _requirements(extra, project)}
    assert {"transformers", "tokenizers"} <= names, names
