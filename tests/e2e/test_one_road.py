"""The config takes one road: composed once (CLI, or the control plane at submit), validated once,
read back into the same model by the job and by each worker; and the package works installed.

    pytest tests/e2e/test_one_road.py -q -s
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli, unprefixed
from timing import scaled

# What the control plane forces into every job (its MLflow store, the job's own directory).
SERVICE_OWNED = [("tracking", "tracking_uri"), ("tracking", "run_id"), ("train", "checkpoint"), ("launch", "log_dir"),
                 # and the tag naming the preset a config was composed from (a document has none)
                 ("tracking", "tags")]
# Modules that compose or validate a config: none of them may run after the server resolved it.
# (Workers do resolve the parallel plan of the model they build: that is the engine's input.)
COMPOSE_OR_VALIDATE = ("hydra", "omegaconf", "trainer.config.compose", "trainer.validate",
                       "trainer.validate.model_checks")


def _without_service_fields(config: dict) -> dict:
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, key in SERVICE_OWNED:
        out[section].pop(key)
    return out


@pytest.mark.parametrize("overrides", [[], ["+parallel=3d", "train.steps=7"], ["model=mlp", "data=regression"]])
def test_rest_resolves_the_config_the_cli_prints(overrides, tmp_path):
    """One source of defaults: REST (overrides, and a config document with only the changes) gives
    the config `python -m trainer --cfg job` prints for the same input; with no input, exactly
    what it prints (a parallel preset states only its own keys, the rest are the section's defaults)."""
    from service.submit import resolve_config
    from trainer.validate.checks import validate_config

    proc = run_cli(["--cfg", "job", *overrides], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cli = yaml.safe_load(proc.stdout)
    common = dict(workspace=tmp_path, workdir=tmp_path / "job", tracking_uri="sqlite:///svc.db", run_id=None)
    by_overrides, _ = resolve_config(overrides=overrides, document=None, **common)
    document = {"model": cli["model"], "data": cli["data"]} if "model=mlp" in overrides else {}
    if "+parallel=3d" in overrides:
        document = {"mesh": cli["mesh"], "parallel": cli["parallel"], "train": {"steps": 7}}
    by_document, _ = resolve_config(overrides=None, document=document, **common)
    expected = _without_service_fields(validate_config(cli).model_dump(mode="json"))
    if not overrides:
        assert expected == _without_service_fields(cli)  # every key printed, every value the default
    assert _without_service_fields(by_overrides.model_dump(mode="json")) == expected
    assert _without_service_fields(by_document.model_dump(mode="json")) == expected


def test_a_submitted_job_is_neither_recomposed_nor_revalidated(tmp_path):
    """The server resolves the job; `python -m trainer.launch job.json` (what the runner starts) and
    its workers import nothing that composes or validates. `-X importtime` reaches the spawned
    workers too (multiprocessing passes the interpreter's -X options on)."""
    from service.runner import trainer_command, write_job_config
    from service.submit import resolve_config

    from trainer.tracking.run_record import launch_plan

    cfg, plan = resolve_config(overrides=["+parallel=dp", "mesh=[2]", "data=synthetic", "tracking=none",
                                          "train.steps=2", "train.global_batch_size=4", "train.seq_len=16"],
                               document=None, workspace=tmp_path, workdir=tmp_path, tracking_uri="sqlite:///svc.db",
                               run_id=None)
    resolved = launch_plan(cfg, plan)
    assert resolved is not None
    write_job_config(tmp_path, cfg.model_dump(mode="json"), resolved.to_dict())  # and its plan, as the server does
    python, *args = trainer_command(tmp_path)
    proc = subprocess.run([python, "-X", "importtime", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=scaled(600),
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "done: steps 1..2" in proc.stdout
    assert "resolving the plan again" not in proc.stderr and "is resolved again" not in proc.stderr
    lines = [unprefixed(line) for line in proc.stderr.splitlines()]  # a worker's lines come as "[rank1]: ..."
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    assert "trainer.run.loop" in imported and "parallel.engine" in imported, sorted(m for m in imported
                                                                                    if m.startswith(("trainer",
                                                                                                     # reached the
                                                                                                     # workers
                                                                                                     "parallel")))
    offenders = sorted(m for m in imported if m.split(".")[0] in ("hydra", "omegaconf") or m in COMPOSE_OR_VALIDATE)
    assert offenders == [], offenders
    # Hugging Face packages are an optional extra, imported only by model=hf and friends.
    assert not [m for m in imported if m.split(".")[0] in ("transformers", "datasets", "tokenizers")]


def test_installed_wheel_trains_from_another_directory(tmp_path):
    """A wheel built as a user would (``pip wheel``, build isolation), installed (not editable) into a
    fresh venv; the package finds its conf/ inside itself.

    Build isolation fetches what pyproject.toml's [build-system] asks for (setuptools), so neither the
    base Python's setuptools nor its ``wheel`` matter. The install takes ``--no-deps --no-index``: the
    dependencies (torch ...) are the running interpreter's, which a ``.pth`` file in the new venv names
    (:func:`see_dependencies_of_this_interpreter`): the running interpreter may itself be a venv (the
    README's test command in one), whose base Python's site-packages lack them."""
    source = tmp_path / "source"  # pip builds in the tree it is given: not in the repository
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "parallel", "trainer", "service", "api"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if copy is shutil.copytree else {}))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels),
                            str(source)],
                           capture_output=True, text=True, timeout=scaled(600))
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("meshflow-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # pip, like every dependency: the running interpreter's
    python = str(env_dir / "bin" / "python")
    see_dependencies_of_this_interpreter(python)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing may shadow the installed wheel
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=scaled(300), env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([python, "-c", "import trainer.config.compose as c; print(c.CONF_DIR)"], cwd=elsewhere,
                           capture_output=True, text=True, timeout=scaled(120), env=env)
    conf_dir = Path(where.stdout.strip())
    assert env_dir in conf_dir.parents and (conf_dir / "parallel" / "3d.yaml").is_file(), where.stdout + where.stderr
    proc = subprocess.run([python, "-m", "trainer", "train.steps=3", "tracking=none", "data=synthetic",
                           "train.global_batch_size=4", "train.seq_len=32"], cwd=elsewhere, capture_output=True,
                          text=True, timeout=scaled(600), env={**env, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "done: steps 1..3" in proc.stdout
    assert sys.executable != python


def see_dependencies_of_this_interpreter(python: str) -> None:
    """Make the running interpreter's site-packages (its venv's, and its base's where the venv includes
    them; its user site) visible to the venv of ``python``: a ``.pth`` file in that venv's site-packages
    naming them, after the venv's own (so the installed wheel comes first). A ``.pth`` line adds its
    directory without running the ``.pth`` files inside it, so this interpreter's editable install of the
    project (an import hook or a path in a ``.pth`` of its own) stays out."""
    import site
    import sysconfig

    ours = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site.ENABLE_USER_SITE:
        ours.append(site.getusersitepackages())
    dirs = list(dict.fromkeys(d for d in ours if Path(d).is_dir()))
    theirs = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                            capture_output=True, text=True, timeout=scaled(60), check=True).stdout.strip()
    (Path(theirs) / "running-interpreter.pth").write_text("".join(f"{d}\n" for d in dirs))


def test_launch_of_a_bad_config_file_says_so(tmp_path):
    (tmp_path / "bad.json").write_text('{"train": {"steps": 0}}')
    for name in ("missing.json", "bad.json"):
        proc = subprocess.run([sys.executable, "-m", "trainer.launch", str(tmp_path / name)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=scaled(120))
        assert proc.returncode == 2 and "not a resolved config" in proc.stderr and "Traceback" not in proc.stderr
