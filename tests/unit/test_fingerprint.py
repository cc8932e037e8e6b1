"""Fingerprints of whole parameters from their blocks (trainer.models.fingerprint): the blocks' shares
add up to the whole tensor's, and a block at the wrong place, a swapped pair of blocks or one wrong
element shows; the tie's other names compare with the first's source."""

from __future__ import annotations

import torch

from trainer.models.fingerprint import fingerprint, mismatches


def _blocks_sum(blocks):
    return tuple(sum(values) for values in zip(*blocks))


def test_blocks_add_up_to_the_whole_tensor():
    full = torch.randn(12, 10, generator=torch.Generator().manual_seed(0))
    whole = fingerprint(full)
    rows = _blocks_sum([fingerprint(full[i:i + 4], (i, 0)) for i in (0, 4, 8)])
    cols = _blocks_sum([fingerprint(full[:, j:j + 5], (0, j)) for j in (0, 5)])
    assert not mismatches({"w": rows}, {"w": whole}, []) and not mismatches({"w": cols}, {"w": whole}, [])
    assert whole[0] == 120


def test_swapped_blocks_a_wrong_offset_and_one_wrong_element_show():
    full = torch.randn(12, 10, generator=torch.Generator().manual_seed(1))
    whole = {"w": fingerprint(full)}
    swapped = _blocks_sum([fingerprint(full[4:8], (0, 0)), fingerprint(full[0:4], (4, 0)), fingerprint(full[8:],
                                                                                                       (8, 0))])
    assert swapped[1:3] == whole["w"][1:3] or abs(swapped[1] - whole["w"][1]) < 1e-9  # same values...
    assert mismatches({"w": swapped}, whole, []) == ["w"]  # ...in the wrong places
    wrong_slice = _blocks_sum([fingerprint(full[0:4], (0, 0)), fingerprint(full[0:4], (4, 0)), fingerprint(full[8:],
                                                                                                           (8, 0))])
    assert mismatches({"w": wrong_slice}, whole, []) == ["w"]
    bumped = full.clone()
    bumped[3, 7] += 1e-3
    assert mismatches({"w": fingerprint(bumped)}, whole, []) == ["w"]
    missing = _blocks_sum([fingerprint(full[0:4], (0, 0)), fingerprint(full[8:], (8, 0))])
    assert mismatches({"w": missing}, whole, []) == ["w"]


def test_a_ties_other_name_compares_with_the_first_names_source():
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    source = {"embed.weight": fingerprint(emb)}
    got = {"embed.weight": fingerprint(emb), "head.weight": fingerprint(emb)}
    assert mismatches(got, source, [["embed.weight", "head.weight"]]) == []
    got["head.weight"] = fingerprint(torch.zeros(6, 4))
    assert mismatches(got, source, [["embed.weight", "head.weight"]]) == ["head.weight"]
