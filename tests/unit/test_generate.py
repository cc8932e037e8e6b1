"""trainer.generate: the sampling loop on a model with known logits, and its command-line errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.export.generate import main, sample


class NextIsPlusOne(nn.Module):
    """Logits that favour ``last id + 1`` (mod 8) strongly and ``last id + 2`` a little."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.full((*ids.shape, 8), -10.0)
        logits.scatter_(-1, ((ids + 1) % 8).unsqueeze(-1), 5.0)
        logits.scatter_(-1, ((ids + 2) % 8).unsqueeze(-1), 4.0)
        return logits


def test_greedy_and_top_k_1_follow_the_likeliest_token_and_stop_at_eos():
    prompt = torch.tensor([3])
    assert sample(NextIsPlusOne(), prompt, max_new_tokens=4, temperature=0).tolist() == [3, 4, 5, 6, 7]
    top1 = sample(NextIsPlusOne(), prompt, max_new_tokens=4, temperature=5.0, top_k=1,
                  generator=torch.Generator().manual_seed(0))
    assert top1.tolist() == [3, 4, 5, 6, 7]
    assert sample(NextIsPlusOne(), prompt, max_new_tokens=10, temperature=0, eos_id=6).tolist() == [3, 4, 5, 6]
    assert sample(NextIsPlusOne(), torch.tensor([0, 1, 2]), max_new_tokens=2, temperature=0,
                  context=1).tolist() == [0, 1, 2, 3, 4]


def test_sampling_is_seeded_and_top_k_2_never_leaves_the_two_likeliest():
    def draw(seed: int) -> list[int]:
        return sample(NextIsPlusOne(), torch.tensor([0]), max_new_tokens=30, temperature=3.0, top_k=2,
                      generator=torch.Generator().manual_seed(seed)).tolist()

    first = draw(1)
    assert first == draw(1) and first != draw(2)
    assert all((b - a) % 8 in (1, 2) for a, b in zip(first, first[1:]))


def test_command_line_errors_name_the_flag_or_the_checkpoint(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "generate failed:" in capsys.readouterr().err
    for flag, value in (("--temperature", "-1"), ("--top-k", "-3"), ("--max-new-tokens", "0")):
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path), "--prompt", "x", flag, value])
        assert stop.value.code == 2 and flag in capsys.readouterr().err
