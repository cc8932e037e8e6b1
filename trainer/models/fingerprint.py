"""Did every rank load what the file holds? Fingerprints of whole parameters, computed from shards.

A parameter's fingerprint is four fp64 numbers of its full value: the element count, the sum, the
sum of squares, and a sum weighted by each element's position (so a block loaded at the wrong
offset, or two shards swapped, shows even when the values themselves are all there). Each rank computes them over the
block it holds (:func:`trainer.models.init.local_box` says where it sits in the full tensor) and
divides by how many ranks hold the same block; summing over the ranks gives the full tensor's.
The source's come from the safetensors file, one tensor at a time, or from the checkpoint that
stored them when it was saved.

    source = file_fingerprints(weight_files(path))          # what the file holds
    check_fingerprints(pm, source, what="model.path")       # raises LoadMismatch naming the parameters
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.model import ParallelModel, shard_count
from parallel.sharding.ties import first_names
from trainer.models.init import canonical_fqn, local_box

Fingerprint = tuple[float, float, float, float]  # (elements, sum, sum of squares, position-weighted sum)
# A loaded fp32 value is the file's exactly (bf16 and fp16 widen exactly), so the only difference is
# the order of fp64 additions: relative 1e-12 of the magnitudes summed. 1e-9 leaves room and still
# sees one wrong element out of a billion.
_REL = 1e-9


class LoadMismatch(RuntimeError):
    """Loaded parameters differ from their source; ``names`` lists them."""

    def __init__(self, names: list[str], what: str, details: list[str]) -> None:
        self.names = names
        super().__init__(f"{what}: {len(names)} parameter{'s' if len(names) != 1 else ''} loaded on this mesh differ "
                         f"from the source ({'; '.join(details[:4])}); refusing to train on wrong weights. This is a "
                         "bug in how the layout loads them: report it with the config, or train on another layout")


def fingerprint(block: torch.Tensor, offset: Iterable[int] = (), shape: Iterable[int] | None = None) -> Fingerprint:
    """The fingerprint of ``block``, the part at ``offset`` of a tensor of ``shape`` (the whole
    tensor by default): its share of the full tensor's four numbers."""
    x = block.detach().to(torch.float64)  # where it is: a GPU adds up its own shards
    offset = tuple(offset) or (0,) * x.dim()
    weighted = x
    for dim in reversed(range(x.dim())):  # contract one dimension at a time with its position weights
        index = torch.arange(offset[dim], offset[dim] + x.shape[dim], dtype=torch.float64, device=x.device)
        weighted = weighted @ ((torch.remainder(index * 7919 + 31 * dim, 997) + 1) / 997)
    return float(x.numel()), float(x.sum()), float(x.square().sum()), float(weighted)


def model_fingerprints(pm: ParallelModel) -> dict[str, Fingerprint]:
    """Every parameter name of the model (a tie under each of its names) -> its full value's
    fingerprint. A collective over the world: every rank gets the same dict."""
    local: dict[str, list[float]] = {}
    holders = pm.replicas
    for part in pm.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            offset, _ = local_box(param)
            block = param.to_local() if hasattr(param, "to_local") else param
            local[canonical_fqn(name)] = [v / (holders // shard_count(param)) for v in fingerprint(block, offset)]
    if pm.mesh is None:
        return {name: as_fingerprint(v) for name, v in local.items()}
    gathered: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    total: dict[str, list[float]] = {}
    for rank_values in gathered:
        for name, values in rank_values.items():
            total[name] = [a + b for a, b in zip(total.get(name, [0.0] * 4), values)]
    return {name: as_fingerprint(v) for name, v in total.items()}


def as_fingerprint(values: Sequence[float]) -> Fingerprint:
    """A fingerprint summed as a list of its four numbers, as the tuple it is."""
    elements, total, squares, weighted = values
    return elements, total, squares, weighted


def module_fingerprints(module: torch.nn.Module) -> dict[str, Fingerprint]:
    """Every parameter name of a plain (unsharded) module -> its fingerprint."""
    return {canonical_fqn(name): fingerprint(p) for name, p in module.named_parameters(remove_duplicate=False)}


def file_fingerprints(files: Iterable[Path | str], *, skip: Callable[[str], bool] = lambda key: False
                      ) -> dict[str, Fingerprint]:
    """The fingerprints of every tensor in safetensors ``files`` (read one tensor at a time), but
    those whose key ``skip`` says."""
    from safetensors import safe_open

    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if "rotary_emb" not in key and not skip(key):  # rotary tables: derived, rebuilt by the model
                    out[key] = fingerprint(f.get_tensor(key))
    return out


def source_fingerprints(files: Sequence[Path | str], *, read: Callable[[], dict[str, Fingerprint]] | None = None
                        ) -> dict[str, Fingerprint]:
    """:func:`file_fingerprints` (or ``read()``: the files' under the model's names, where they name
    them otherwise), read by rank 0 only and sent to every rank (a collective when a process group is up)."""
    read = read or (lambda: file_fingerprints(files))
    if not (dist.is_available() and dist.is_initialized()):
        return read()
    box = [read() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None, "rank 0 sent its fingerprints"
    return box[0]


def mismatches(got: dict[str, Fingerprint], want: dict[str, Fingerprint], tied: list[list[str]]) -> list[str]:
    """The names whose fingerprints differ (a tie's other names compared with the first's source)."""
    first = first_names(tied)
    out = []
    for name, values in sorted(got.items()):
        expected = want.get(name, want.get(first.get(name, ""), None))
        if expected is None:
            continue
        (n, total, squares, weighted), (n0, total0, squares0, weighted0) = values, expected
        # sqrt(n * sum of squares) bounds the sum of the magnitudes that were added up.
        bound = _REL * math.sqrt(max(n0, 1.0) * max(squares0, squares)) + 1e-30
        if (round(n) != round(n0) or abs(total - total0) > bound or abs(weighted - weighted0) > bound
                or abs(squares - squares0) > _REL * squares0 + 1e-30):
            out.append(name)
    return out


def check_fingerprints(pm: ParallelModel, want: dict[str, Fingerprint], *, what: str) -> None:
    """Raise :class:`LoadMismatch` on every rank unless this rank's parameters, summed over the
    world, match ``want`` (a collective). ``what``: where the weights came from (a config path)."""
    got = model_fingerprints(pm)
    bad = mismatches(got, want, pm.tied_names)
    if bad:
        first = first_names(pm.tied_names)
        details = [f"{n}: sum of squares {got[n][2]:.9g}, source "
                   f"{want.get(n, want.get(first.get(n, ''), (0.0,) * 4))[2]:.9g}"
                   for n in bad]
        raise LoadMismatch(bad, what, details)
