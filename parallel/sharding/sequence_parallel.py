"""Sequence parallelism inside tensor-parallel blocks (Korthikanti et al. 2022, Megatron-LM).

    apply_sequence_parallel(modules, mesh, norms={"layers.0.attn_norm": ("tp", 1), ...}, col={...})

A block's norms run on sequence shards (torch's ``SequenceParallel``); each norm's output is
all-gathered once along the sequence and fed to the block's column-parallel projections (attention's
wq/wk/wv, the MLP's w1/w3); the row-parallel outputs reduce-scatter back into shards. The first block
of a run of consecutive such blocks slices its input, the last gathers its output, so whatever follows
(the final norm, the head, the next pipeline stage) sees ordinary replicated tensors.

**Backward re-gathers the block input** (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
keeps its input's sequence shard and gathers it again for the weight gradient). Left alone, autograd
would keep the whole gathered tensor for every projection's weight gradient: ~2 of a block's ~5 ``s*h``
activation units at tp 8. Here each block's forward runs under saved-tensor hooks (:class:`_BlockHooks`)
that store a gathered norm output, or any view of it, as the norm's shard plus how to gather it; the
first unpack in backward all-gathers it once, and the other projections reading the same input (wk, wv
after wq; w3 after w1; LoRA's ``lora_A``) reuse that gather, which dies with their saved tensors. The
autograd engine runs one graph in the same order on every rank, so these backward gathers do too.

Why by hand: torch's ``ColwiseParallel`` keeps whatever input it is given for backward (so does its
``input_layouts=Shard(1)`` form, which moreover gathers once per projection), and torch's fused
alternative, async tensor parallelism (``_micro_pipeline_tp`` over symmetric memory), needs CUDA and
``torch.compile``. Under ``torch.compile`` these hooks stand aside (the compiled block decides what it
saves). Another saved-tensor hook already active (activation checkpointing's, a caller's census) is
kept: the hooks hand it everything, the gathered input as its shard, so a checkpointed block keeps only
its input as before and recomputes the shard in backward, then gathers it (Megatron's count too).

Under autocast the shard is cast to the compute dtype before the gather, as every projection would cast
the gathered input: the projections then save the gathered tensor itself rather than a copy each, and
the all-gather moves half the bytes. The norm's gradient comes back in that dtype (Megatron's, too).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from parallel.mesh import submesh
from parallel.sharding.tp_styles import block_of, is_within

# The saved-tensor hooks active before a block's own: (pack, unpack).
SavedHooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def apply_sequence_parallel(modules: Mapping[str, nn.Module], mesh: DeviceMesh, *, norms: Mapping[str, tuple[str, int]],
                            col: Mapping[str, str], regather: bool = True) -> None:
    """Sequence parallelism on the ``norms`` (FQN -> ``(axis, sequence dim)``) of ``modules`` (a model's
    ``named_modules()``), whose blocks hold the column-parallel Linears ``col`` (FQN -> axis).

    Args:
        regather: keep each gathered norm output for backward as its shard and gather it again there
            (default ``True``); ``False`` keeps the whole gathered tensor, as torch's styles do.
    """
    blocks = {block_of(name): axis_dim for name, axis_dim in norms.items()}
    scopes = {block: _BlockHooks(modules[block]) for block in blocks if regather and block not in norms}
    for name, (axis, dim) in norms.items():
        keep_dtensor = any(col.get(c) == axis for c in col if is_within(c, block_of(name)))
        _sequence_parallel(modules[name], submesh(mesh, axis), dim=dim, keep_dtensor=keep_dtensor,
                           scope=scopes.get(block_of(name)))
    _scatter_gather_runs(modules, blocks, mesh)


def _sequence_parallel(norm: nn.Module, mesh: DeviceMesh, *, dim: int, keep_dtensor: bool,
                       scope: _BlockHooks | None) -> None:
    """``SequenceParallel`` on ``norm``, then one all-gather of its output along the sequence.

    Gathering here (not in each column-parallel projection) costs one all-gather per norm in
    forward and one reduce-scatter in backward. The output stays a ``Replicate`` DTensor when
    column-parallel projections consume it, so their input gradients (``Partial``) add up as
    DTensors and are reduce-scattered once. A frozen norm weight (LoRA's base) stays frozen:
    ``SequenceParallel`` makes new parameters, which would train.
    """
    frozen = [name for name, p in norm.named_parameters() if not p.requires_grad]
    parallelize_module(norm, mesh, SequenceParallel(sequence_dim=dim))
    for name in frozen:
        norm.get_parameter(name).requires_grad_(False)

    def gather(_mod: nn.Module, _inputs: Any, output: DTensor) -> torch.Tensor:
        device = output.device.type
        if torch.is_autocast_enabled(device) and output.dtype == torch.float32:
            output = output.to(torch.get_autocast_dtype(device))  # type: ignore[assignment]  # a DTensor's is one
        full = output.redistribute(mesh, [Replicate()])
        if scope is not None:
            scope.remember(output, full)
        return full if keep_dtensor else full.to_local()

    norm.register_forward_hook(gather)


class _BlockHooks:
    """The saved-tensor hooks of one sequence-parallel block: entered by the block's forward pre-hook,
    left by its forward hook (which runs even when the forward raises, as checkpointing's early stop
    does inside a recomputation); :meth:`remember` registers a gathered norm output of this forward."""

    def __init__(self, block: nn.Module) -> None:
        self.active: list[_SavedInputs] = []
        block.register_forward_pre_hook(self.enter)
        block.register_forward_hook(self.leave, always_call=True)

    def enter(self, _mod: nn.Module, _args: tuple[Any, ...]) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() \
                or not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # no stub
            return
        # torch offers the active pair only privately; it is kept (see the module docstring).
        hooks = _SavedInputs(torch._C._autograd._top_saved_tensors_default_hooks(False))
        torch._C._autograd._push_saved_tensors_default_hooks(hooks.pack, hooks.unpack)
        self.active.append(hooks)

    def leave(self, _mod: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        if torch.compiler.is_compiling() or not self.active:
            return
        torch._C._autograd._pop_saved_tensors_default_hooks()
        # The saved tensors keep what they need; the list would keep every gathered input of the block alive.
        self.active.pop().inputs.clear()

    def remember(self, shard: DTensor, full: DTensor) -> None:
        if self.active and not torch.compiler.is_compiling():
            hooks = self.active[-1]
            hooks.inputs.append(_GatheredInput(shard, full, hooks.outer))


class _SavedInputs:
    """A pack / unpack pair: a view of a gathered input is stored as :class:`_SavedView`, anything else
    as the hooks active before (``outer``) store it, or itself (detached: a saved output must not keep its
    own ``grad_fn`` alive through the pack)."""

    def __init__(self, outer: SavedHooks | None) -> None:
        self.outer = outer
        self.inputs: list[_GatheredInput] = []

    def pack(self, t: torch.Tensor) -> Any:
        for gathered in self.inputs:
            view = gathered.view_of(t)
            if view is not None:
                return view
        return self.outer[0](t) if self.outer is not None else t.detach()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedView):
            return packed.unpack()
        return self.outer[1](packed) if self.outer is not None else packed


class _GatheredInput:
    """A norm's gathered output: recognises its views while the block runs forward; keeps the norm's
    shard (or what the outer hooks made of it) from the first view saved; gathers it once in backward."""

    def __init__(self, shard: DTensor, full: DTensor, outer: SavedHooks | None) -> None:
        with torch.no_grad():
            local = full.to_local()
            self._shard: Any = shard.to_local().detach()
        self._full_ref = weakref.ref(local)  # only while forward uses it: storage identity needs it alive
        self._storage = local.untyped_storage()._cdata
        # A fresh gather is contiguous from offset 0; a base laid out otherwise is not taken over.
        self._usable = local.is_contiguous() and local.storage_offset() == 0
        self._spec = (shard.device_mesh, shard.placements, shard.shape, shard.stride())
        self._full_shape = local.shape
        self._outer = outer
        self._packed = False
        self._full: torch.Tensor | None = None

    def view_of(self, t: torch.Tensor) -> _SavedView | None:
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        with torch.no_grad():
            local = t.to_local() if isinstance(t, DTensor) else t
        base = self._full_ref()
        if (not self._usable or base is None or type(local) not in (torch.Tensor, nn.Parameter)
                or local.dtype != base.dtype or local.untyped_storage()._cdata != self._storage):
            return None
        if not self._packed:  # the shard, stored once, as the outer hooks would store it
            self._shard = self._outer[0](self._shard) if self._outer is not None else self._shard
            self._packed = True
        return _SavedView(self, local.size(), local.stride(), local.storage_offset(), spec)

    def full(self) -> torch.Tensor:
        """The gathered input, all-gathered from the shard the first time backward asks for it."""
        if self._full is None:
            shard = self._outer[1](self._shard) if self._outer is not None else self._shard
            mesh, placements, shape, stride = self._spec
            with torch.no_grad():
                sharded = DTensor.from_local(shard, mesh, placements, run_check=False, shape=shape, stride=stride)
                self._full = sharded.redistribute(mesh, [Replicate()] * mesh.ndim).to_local().contiguous()
            self._shard = None
        return self._full


class _SavedView:
    """What a projection saved of a gathered input: its holder and the view's layout (a DTensor's mesh,
    placements, shape and stride)."""

    def __init__(self, gathered: _GatheredInput, size: torch.Size, stride: tuple[int, ...], offset: int | torch.SymInt,
                 spec: Any) -> None:
        self.gathered, self.size, self.stride, self.offset, self.spec = gathered, size, stride, offset, spec

    def unpack(self) -> torch.Tensor:
        local = self.gathered.full().as_strided(self.size, self.stride, self.offset)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _scatter_gather_runs(modules: Mapping[str, nn.Module], sp_blocks: Mapping[str, tuple[str, int]],
                         mesh: DeviceMesh) -> None:
    """Keep the residual stream sequence-sharded across runs of consecutive sequence-parallel
    blocks: the first block of a run slices its input (no communication), the last one
    all-gathers its output."""
    by_parent: dict[str, list[str]] = {}
    for block in sp_blocks:
        by_parent.setdefault(block.rpartition(".")[0], []).append(block)
    for parent, blocks in by_parent.items():
        prefix = f"{parent}." if parent else ""
        position = {f"{prefix}{child}": i for i, (child, _) in enumerate(modules[parent].named_children())}
        blocks.sort(key=position.__getitem__)
        runs: list[list[str]] = []
        for block in blocks:
            last = runs[-1][-1] if runs else None
            if last is not None and position[block] == position[last] + 1 and sp_blocks[block] == sp_blocks[last]:
                runs[-1].append(block)
            else:
                runs.append([block])
        for run in runs:
            axis, dim = sp_blocks[run[0]]
            _scatter_input(modules[run[0]], submesh(mesh, axis), dim)
            _gather_output(modules[run[-1]], submesh(mesh, axis), dim)


def _scatter_input(module: nn.Module, mesh: DeviceMesh, dim: int) -> None:
    def scatter(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if isinstance(x, DTensor):
            shard = x.redistribute(mesh, [Shard(dim)]).to_local()
        else:
            shard = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh,
                                                                                             [Shard(dim)]).to_local()
        return (shard, *args[1:])

    # prepend: runs before SequenceParallel's own input hook when the block is the norm itself.
    module.register_forward_pre_hook(scatter, prepend=True)


def _gather_output(module: nn.Module, mesh: DeviceMesh, dim: int) -> None:
    def gather(_mod: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        if isinstance(output, DTensor):
            return output.redistribute(mesh, [Replicate()]).to_local()
        return DTensor.from_local(output, mesh, [Shard(dim)], run_check=False).redistribute(mesh,
                                                                                            [Replicate()]).to_local()

    module.register_forward_hook(gather)


__all__ = ["apply_sequence_parallel"]
