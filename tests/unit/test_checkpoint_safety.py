"""A checkpoint never runs code: crafted ``.metadata``, extra state and DCP items are refused by
resume, export and generate, and the checkpoints they refuse would have run a command.

Run: ``python -m pytest tests/unit/test_checkpoint_safety.py -q``
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parallel.errors import ConfigError
from trainer.checkpoint.dcp import CheckpointError, read_extra
from trainer.checkpoint.extra_state import EXTRA_FILE, decode, encode
from trainer.checkpoint.safe_read import METADATA_FILE, UnsafeCheckpoint, load_dcp, quiet_dcp, read_metadata_file
from trainer.export.generate import main as generate_main
from trainer.export.weights import export_checkpoint, unique_state_dict
from trainer.export.weights import main as export_main
from trainer.run.loop import train
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker

TINY = ["train.steps=2", "train.global_batch_size=4", "train.seq_len=16", "data.max_bytes=20000", "tracking=none",
        "model.dim=32", "model.n_layers=1", "model.n_heads=2", "train.checkpoint.every=1"]


class RunsCommand:
    """Unpickling it runs ``touch MARKER``: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real tiny run: two steps, a checkpoint after each; its config, losses and directory."""
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    ckpt_dir = tmp_path_factory.mktemp("run") / "checkpoints"
    compose = lambda *more: validate_config(compose_dict([*TINY, f"train.checkpoint.dir={ckpt_dir}", *more]))  # noqa: E731
    losses = train(compose(), tracker=NullTracker(), progress=NullProgress()).losses
    return compose, losses, ckpt_dir


def _copy(run, tmp_path: Path, step: int = 1) -> Path:
    _, _, ckpt_dir = run
    return Path(shutil.copytree(ckpt_dir / f"step_{step:08d}", tmp_path / f"step_{step:08d}"))


def _resave_as_legacy(src: Path, dst: Path, extra_blob: bytes) -> Path:
    """``src`` rewritten as earlier versions wrote it: the extra state a pickled DCP item, no extra.safetensors."""
    with open(src / METADATA_FILE, "rb") as f:
        stored = read_metadata_file(f).state_dict_metadata
    state = {key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata)
             else None
             for key, item in stored.items()}
    load_dcp(state, src)
    state["extra"] = extra_blob
    with quiet_dcp():
        dcp.save(state, checkpoint_id=dst, no_dist=True)
    (dst / "COMPLETE").write_text("{}")
    return dst


def _attempts(run, path: Path, tmp_path: Path, capsys) -> list[str]:
    """Resume, export and generate from ``path``: the error each one gives."""
    compose, _, _ = run
    errors = []
    with pytest.raises((CheckpointError, ConfigError)) as info:  # validation reads the extra state first
        train(compose(f"train.checkpoint.resume={path}"), tracker=NullTracker(), progress=NullProgress())
    errors.append(str(info.value))
    assert export_main([str(path), "--out", str(tmp_path / "out.safetensors")]) == 2
    assert generate_main([str(path), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    errors += [line for line in err.splitlines() if line.startswith(("export failed", "generate failed"))]
    assert len(errors) == 3, err
    assert not (tmp_path / "out.safetensors").exists()
    return errors


def test_crafted_metadata_runs_nothing_on_resume_export_or_generate(run, tmp_path, capsys):
    path, marker = _copy(run, tmp_path), tmp_path / "pwned"
    with open(path / METADATA_FILE, "rb") as f:
        metadata = read_metadata_file(f)
    metadata.storage_meta.modules = [RunsCommand(marker)]
    (path / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    pickle.loads((path / METADATA_FILE).read_bytes())  # what torch's own reader would do
    assert marker.exists(), "the crafted metadata must run its command when plainly unpickled"
    marker.unlink()

    for error in _attempts(run, path, tmp_path, capsys):
        assert f"refusing checkpoint {str(path)!r}" in error and "posix.system" in error, error
        assert "weights_only=False" not in error and "do not load it" in error, error
    assert not marker.exists()


def test_the_cli_refuses_a_crafted_metadata_as_a_config_error(run, tmp_path):
    """Refused by validation (exit 2, one message), not in the worker through a traceback (exit 1)."""
    from tests.conftest import run_cli

    path, marker = _copy(run, tmp_path), tmp_path / "pwned"
    with open(path / METADATA_FILE, "rb") as f:
        metadata = read_metadata_file(f)
    metadata.storage_meta.modules = [RunsCommand(marker)]
    (path / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConfigError) as info:
        run[0](f"train.checkpoint.resume={path}")
    [issue] = info.value.issues
    assert issue.path == "train.checkpoint.resume" and "posix.system" in issue.reason, issue
    proc = run_cli([*TINY, f"train.checkpoint.dir={tmp_path / 'new'}", f"train.checkpoint.resume={path}"],
                   cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"train.checkpoint.resume: refusing checkpoint {str(path)!r}" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()


def test_crafted_legacy_extra_state_runs_nothing(run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    blob = pickle.dumps({"step": 1, "model_config": RunsCommand(marker)})
    path = _resave_as_legacy(_copy(run, tmp_path), tmp_path / "legacy", blob)
    pickle.loads(blob)
    assert marker.exists()
    marker.unlink()

    for error in _attempts(run, path, tmp_path, capsys):
        assert f"refusing checkpoint {str(path)!r}" in error and "'extra'" in error and "posix.system" in error, error
    assert not marker.exists()


def test_crafted_dcp_item_runs_nothing(run, tmp_path):
    """A non-tensor item (here the optimizer's lr) is a pickle DCP itself reads with weights_only=False."""
    compose, _, _ = run
    marker, src = tmp_path / "pwned", _copy(run, tmp_path)
    with open(src / METADATA_FILE, "rb") as f:
        stored = read_metadata_file(f).state_dict_metadata
    state = {key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata)
             else None
             for key, item in stored.items()}
    load_dcp(state, src)
    lr_key = next(key for key in state if key.endswith(".lr"))
    state[lr_key] = RunsCommand(marker)
    path = tmp_path / "crafted"
    with quiet_dcp():
        dcp.save(state, checkpoint_id=path, no_dist=True)
    (path / "COMPLETE").write_text("{}")
    shutil.copy(src / EXTRA_FILE, path / EXTRA_FILE)
    torch.load(io.BytesIO(_item_bytes(path, lr_key)), weights_only=False)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CheckpointError, match=rf"refusing checkpoint .*{path.name}.*{lr_key}.*posix\.system"):
        train(compose(f"train.checkpoint.resume={path}"), tracker=NullTracker(), progress=NullProgress())
    assert not marker.exists()


def _item_bytes(path: Path, key: str) -> bytes:
    """The raw bytes DCP stored for ``key``: what its default planner hands to torch.load."""
    with open(path / METADATA_FILE, "rb") as f:
        metadata = read_metadata_file(f)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def test_metadata_must_be_dcp_metadata_with_its_files_inside(tmp_path):
    with pytest.raises(UnsafeCheckpoint, match="holds a dict, not DCP Metadata"):
        read_metadata_file(io.BytesIO(pickle.dumps({"a": 1})))
    with pytest.raises(UnsafeCheckpoint, match=r"global builtins\.eval"):
        read_metadata_file(io.BytesIO(pickle.dumps(eval)))


def test_data_file_outside_the_checkpoint_is_refused(run, tmp_path):
    path = _copy(run, tmp_path)
    with open(path / METADATA_FILE, "rb") as f:
        metadata = read_metadata_file(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (path / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"refusing .*'\.\./\.\./\.\./etc/passwd', outside the checkpoint"):
        export_checkpoint(path, tmp_path / "out.safetensors")


def test_resume_continues_exactly_and_export_matches(run, tmp_path):
    """The ordinary path: JSON extra state (RNG, scheduler, loader) resumes to the same loss."""
    compose, losses, ckpt_dir = run
    step1 = ckpt_dir / "step_00000001"
    assert (step1 / EXTRA_FILE).is_file()
    resumed = train(compose(f"train.checkpoint.resume={step1}", f"train.checkpoint.dir={tmp_path}"),
                    tracker=NullTracker(), progress=NullProgress())
    assert resumed.first_step == 1 and resumed.losses == [losses[1]]

    info = export_checkpoint(ckpt_dir / "step_00000002", tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    from trainer.export.weights import load_checkpoint_model

    model, _, extra = load_checkpoint_model(ckpt_dir / "step_00000002")
    assert extra["step"] == 2 and info["tensors"] == len(unique_state_dict(model))
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in unique_state_dict(model).items())


def test_legacy_checkpoint_of_plain_data_still_resumes(run, tmp_path):
    """Earlier versions' pickled extra state is read with weights_only=True: same step, same loss."""
    compose, losses, ckpt_dir = run
    extra = read_extra(ckpt_dir / "step_00000001")
    version, internal, gauss = extra["rng"]["python"]
    extra["rng"]["python"] = (version, tuple(internal), gauss)  # as random.getstate() gave it
    blob = io.BytesIO()
    torch.save(extra, blob)
    path = _resave_as_legacy(_copy(run, tmp_path), tmp_path / "legacy", blob.getvalue())
    assert not (path / EXTRA_FILE).exists()
    resumed = train(compose(f"train.checkpoint.resume={path}", f"train.checkpoint.dir={tmp_path}"),
                    tracker=NullTracker(), progress=NullProgress())
    assert resumed.losses == [losses[1]]


def test_extra_state_round_trip_and_what_json_cannot_hold():
    rng = torch.get_rng_state()
    text, tensors = encode({"step": 3, "rng": {"torch": rng, "python": (3, (1, 2), None)}, "x": [1.5, float("inf")]})
    back = decode(text, tensors)
    assert torch.equal(back["rng"]["torch"], rng) and back["rng"]["python"] == [3, [1, 2], None]
    assert back["step"] == 3 and back["x"] == [1.5, float("inf")]
    with pytest.raises(TypeError, match=r"loader\.pos is a PosixPath"):
        encode({"loader": {"pos": Path("x")}})
    with pytest.raises(TypeError, match="has the key 1"):
        encode({"scheduler": {1: 2}})


def test_extra_json_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    import datetime

    from trainer.checkpoint.dcp import save_checkpoint

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"extra state: when is a datetime; store JSON values"):
        save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                        extra={"step": 1, "when": datetime.datetime.now()}, keep=1)
    assert not (tmp_path / "ckpt").exists()
