"""Checkpoints without a process group: exact resume, retention, atomicity, clear errors.

Run: ``pytest tests/unit/test_checkpoint.py -q``
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.dcp import (
    COMPLETE_MARKER,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)

BATCHES = [(torch.randn(8, 6, generator=g),
            torch.randn(8, 3, generator=g)) for g in [torch.Generator().manual_seed(0)] for _ in range(8)]


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = BATCHES[step]
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def save(ckpt_dir: Path, step: int, keep: int = 3) -> Path:
    model, optimizer = build()
    return save_checkpoint(ckpt_dir, step, model=model, optimizer=optimizer, extra={"step": step}, keep=keep)


def test_resume_gives_identical_losses(tmp_path: Path) -> None:
    model, optimizer = build(seed=0)
    train(model, optimizer, range(3))
    extra = {"step": 3, "rng": torch.get_rng_state(), "py_rng": random.getstate(),
             "config": {"lr": 1e-2, "dims": [1, 2]}}
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, extra=extra, keep=2)
    assert path == tmp_path / "step_00000003"
    expected = train(model, optimizer, range(3, 5))

    fresh_model, fresh_optimizer = build(seed=1)  # different init: everything must come from the file
    loaded = load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer)
    assert train(fresh_model, fresh_optimizer, range(3, 5)) == expected
    assert loaded["step"] == 3 and loaded["config"] == {"lr": 1e-2, "dims": [1, 2]}
    version, internal, gauss = extra["py_rng"]  # stored as JSON: tuples come back as lists
    assert torch.equal(loaded["rng"], extra["rng"]) and loaded["py_rng"] == [version, list(internal), gauss]


def test_checkpoint_is_one_directory(tmp_path: Path) -> None:
    path = save(tmp_path / "ckpts", 7)
    assert [p.name for p in (tmp_path / "ckpts").iterdir()] == ["step_00000007"]
    assert {".metadata", COMPLETE_MARKER} <= {p.name for p in path.iterdir()}


def test_keep_leaves_the_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000040"


def test_keep_never_deletes_the_checkpoint_just_saved(tmp_path: Path) -> None:
    save(tmp_path, 30, keep=1)
    path = save(tmp_path, 20, keep=1)  # resumed from an older step: 30 still outranks it
    assert path.is_dir() and latest_checkpoint(tmp_path) == tmp_path / "step_00000030"


def test_latest_ignores_unfinished_directories(tmp_path: Path) -> None:
    save(tmp_path, 5)
    (tmp_path / ".tmp-step_00000009-deadbeef").mkdir()  # a save killed before its rename
    (tmp_path / "step_00000008").mkdir()  # right name, no COMPLETE marker
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000005"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = build()
    train(model, optimizer, range(2))
    good = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, extra={"step": 2}, keep=3)
    reference = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, range(2, 4))

    real_save = dcp.save
    written: list[Path] = []

    def save_then_crash(state, *, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # the data files are on disk ...
        written.extend(Path(checkpoint_id).iterdir())
        raise OSError("disk full")  # ... but the save never finishes

    monkeypatch.setattr(dcp, "save", save_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, model=model, optimizer=optimizer, extra={"step": 4}, keep=3)
    monkeypatch.undo()

    assert any(p.name == ".metadata" for p in written)
    assert latest_checkpoint(tmp_path) == good
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002"]  # the half-written save was tidied
    fresh_model, fresh_optimizer = build(seed=1)
    assert load_checkpoint(good, model=fresh_model, optimizer=fresh_optimizer) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), reference))


def test_next_save_removes_stale_tmp_dirs(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-step_00000003-0badc0de"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"partial")
    save(tmp_path, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000004"]


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 6)
    model, optimizer = build(seed=3)
    path = save_checkpoint(tmp_path, 6, model=model, optimizer=optimizer, extra={"step": 6, "again": True}, keep=3)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000006"]
    fresh_model, fresh_optimizer = build()
    assert load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer)["again"] is True


def test_missing_checkpoint_raises_with_path(tmp_path: Path) -> None:
    missing = tmp_path / "step_00000099"
    model, optimizer = build()
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(missing, model=model, optimizer=optimizer)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("damage", ["truncate_data", "delete_data", "delete_metadata"])
def test_corrupt_checkpoint_raises_with_path(tmp_path: Path, damage: str) -> None:
    path = save(tmp_path, 1)
    data_file = next(path.glob("*.distcp"))
    if damage == "truncate_data":
        data_file.write_bytes(data_file.read_bytes()[:100])
    elif damage == "delete_data":
        data_file.unlink()
    else:
        (path / ".metadata").unlink()
    model, optimizer = build()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, model=model, optimizer=optimizer)
    assert str(path) in str(info.value)


def test_mismatched_model_raises_with_path(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    wider = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    with pytest.raises(CheckpointError, match="[Ss]ize mismatch") as info:
        load_checkpoint(path, model=wider, optimizer=torch.optim.AdamW(wider.parameters()))
    assert str(path) in str(info.value)


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # empty dir: start fresh
    first, second = save(tmp_path, 1), save(tmp_path, 2)
    assert resolve_resume("auto", tmp_path) == second
    assert resolve_resume(str(first), tmp_path) == first
    assert resolve_resume("step_00000001", tmp_path) == first  # relative to the checkpoint dir

    bad = tmp_path / "step_00000042"
    with pytest.raises(CheckpointError) as info:
        resolve_resume(str(bad), tmp_path)
    message = str(info.value)
    assert str(bad) in message and "train.checkpoint.resume" in message
    assert "does not exist" in message and "auto" in message

    (second / COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointError, match="COMPLETE"):
        resolve_resume(str(second), tmp_path)


def test_a_resume_says_which_optimizer_settings_of_the_checkpoint_it_kept(tmp_path: Path) -> None:
    """The optimizer's and the schedule's state come back as saved, changed config values included (a
    higher optim.lr has no effect on a resume): the run names each one it kept, and nothing when they agree."""
    from trainer.config.schema import OptimConfig
    from trainer.run.checkpointing import kept_optimizer_settings

    def built(lr: float):
        model, _ = build(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    model, optimizer, scheduler = built(1e-2)
    train(model, optimizer, range(2))
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer,
                           extra={"step": 2, "scheduler": scheduler.state_dict()}, keep=1)
    for lr, kept in [(2e-2, ["optim.lr=0.02 (the checkpoint's 0.01)"]), (1e-2, [])]:
        fresh_model, fresh_optimizer, fresh_scheduler = built(lr)
        extra = load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer)
        fresh_scheduler.load_state_dict(extra["scheduler"])
        assert fresh_optimizer.param_groups[0]["lr"] == 1e-2 and fresh_scheduler.base_lrs == [1e-2]  # as saved
        assert kept_optimizer_settings(fresh_optimizer, fresh_scheduler,
                                       OptimConfig(lr=lr, betas=(0.9, 0.999), weight_decay=0.1)) == kept
    assert kept_optimizer_settings(fresh_optimizer, fresh_scheduler, OptimConfig(lr=1e-2, eps=1e-6)) == [
        "optim.betas=[0.9, 0.95] (the checkpoint's [0.9, 0.999])", "optim.eps=1e-06 (the checkpoint's 1e-08)"]
