"""A checkpoint that does not fit says "disk full at PATH" (trainer.run.disk), not torch's
"unexpected pos 704 vs 598": on a real full filesystem (a small tmpfs, when this user may mount
one) and with ENOSPC injected at DCP's write (anywhere).

    python -m pytest tests/unit/test_disk_full.py -q
"""

from __future__ import annotations

import errno
import subprocess

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.run.disk import DiskFullError
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker

# ~0.5M parameters: weights, grads and AdamW state of a few MiB, one checkpoint at step 2.
TINY = ["data=synthetic", "model.dim=64", "model.n_layers=2", "model.vocab_size=2048", "train.steps=2",
        "train.seq_len=16", "train.global_batch_size=2", "train.checkpoint.every=2", "tracking=none"]


def _train(checkpoints) -> None:
    from trainer.run.loop import train

    cfg = RunConfig.model_validate(compose_dict([*TINY, f"train.checkpoint.dir={checkpoints}"]))
    train(cfg, tracker=NullTracker(), progress=NullProgress())


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs at ``tmp_path / "disk"``; skips where this user may not mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_checkpoint_on_a_full_filesystem_says_disk_full(small_disk):
    with pytest.raises(DiskFullError) as err:
        _train(small_disk / "checkpoints")
    message = str(err.value)
    assert f"disk full at {small_disk / 'checkpoints'}: " in message and "of 0.2 MiB" in message
    assert "unexpected pos" not in message and "train.checkpoint.keep" in message


def test_enospc_at_the_write_says_disk_full(tmp_path, monkeypatch):
    def no_space(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ck" / "x.distcp"))

    monkeypatch.setattr(dcp_filesystem, "_write_item", no_space)
    with pytest.raises(DiskFullError) as err:
        _train(tmp_path / "ck")
    assert str(err.value).startswith(f"[Errno {errno.ENOSPC}] disk full at {tmp_path / 'ck' / 'x.distcp'}: ")
