"""The memory model's meta pass: one forward and backward of a micro-batch on the meta device, at
tp-local shapes (:func:`_local_shapes`), counting what autograd saves per unit and block and every
tensor's life (:class:`_Census`): :func:`saved_activations`, which
:func:`trainer.planner.memory.predict.predict_memory` turns into a peak.

On CPU the real attention kernel keeps only its log-sum-exp (not the T x T scores); the meta
device would take the math path and count the scores, so the counting pass runs the fused
kernel (:func:`flash_attention_for_cpu`) through a torch function mode of its own thread
(:class:`AttentionKernel`), never by patching ``torch`` for the process. Context parallelism runs
a rank's queries over the whole row (:func:`_over_the_row`). Sequence parallelism runs the blocks' norms
on 1/tp of the rows; their outputs, which the engine gathers for the projections, are kept for backward
as those shards and gathered again in backward (:class:`_Regather`), as
:mod:`parallel.sharding.sequence_parallel` does. A 2-D / 2.5-D grid's or 3-D cube's blocks run whole, each op
counted at the rank's share and each Linear with its own gathered input and weight block
(:mod:`trainer.planner.memory.layout_census`, :mod:`parallel.plan.split`). The time model's pass
(:func:`trainer.planner.cost.model.unit_pass`) uses the same kernel, mode and shapes.
"""

from __future__ import annotations

import copy
import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.context import ring_alone
from parallel.plan.spec import ParallelPlan, owning_unit
from parallel.sharding.tp_styles import with_ties
from trainer.config.model_schema import MLPConfig
from trainer.config.schema import RunConfig
from trainer.models import loss_fn_for
from trainer.models.skeleton import meta_model
from trainer.planner.memory.layout import expert_split
from trainer.planner.memory.layout_census import LayoutCensus
from trainer.planner.numbers import held_placements


def flash_attention_for_cpu(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as a CPU run computes it: without a mask the fused flash
    kernel, which saves q, k, v, the output and a log-sum-exp per row (the meta device alone would
    take the math path and save the T x T scores); with a mask the real function, as CPU does too."""
    if attn_mask is not None:
        # Called from AttentionKernel.__torch_function__, where torch has popped the mode: the real SDPA.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]


class AttentionKernel(TorchFunctionMode):
    """While active, every ``F.scaled_dot_product_attention`` call (the built-in Llama's, transformers'
    sdpa attention's) runs ``kernel``, which takes the same arguments. A torch function mode belongs to
    the thread that entered it, like the pass's dispatch mode and saved-tensor hooks: plans counted
    at once in the control plane's thread pool never see each other's kernel, and ``F`` is not
    reassigned. While ``kernel`` runs the mode is popped, so a kernel may call the real function."""

    def __init__(self, kernel: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.scaled_dot_product_attention:  # what F.scaled_dot_product_attention is
            return self.kernel(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


# A time model's pass runs the ring's every block up to this cp size (each its kernel launches and
# merge, as the ring runs them); beyond it, the received blocks as one call (ring_alone's ``merged``):
# a pass of gpt_175b at cp 64 would otherwise dispatch 64 blocks' ops in each of 96 layers.
RING_BLOCKS_PRICED = 8


def _over_the_row(kernel: Callable[..., torch.Tensor], plan: ParallelPlan, *,
                  memory: bool = False) -> Callable[..., torch.Tensor]:
    """Context parallelism: a rank's queries over the whole row, by the ring's arithmetic over cp blocks
    (:func:`parallel.context.ring_alone`: every device runs the fused ring; ``memory``: 3 blocks at
    most, which keep and peak at what cp blocks do) or by ``kernel`` over K/V repeated to the row (the
    all-gather's)."""
    cp = plan.cp_size
    if cp == 1:
        return kernel

    def attend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if plan.context_parallel.method == "ring":
            if memory:
                return ring_alone(q, k, v, blocks=min(cp, 3), causal=is_causal, scale=scale)
            return ring_alone(q, k, v, blocks=cp, causal=is_causal, scale=scale, merged=cp > RING_BLOCKS_PRICED)
        k, v = k.repeat(1, 1, cp, 1), v.repeat(1, 1, cp, 1)
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        return kernel(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)

    return attend


def _local_shapes(model: nn.Module, plan: ParallelPlan) -> None:
    """Give every tensor-parallel parameter of the meta ``model`` its local shape (in place), LoRA's
    adapters as their base's tp style shards them (:func:`~trainer.planner.numbers.held_placements`). A
    tied parameter (the embedding that is also the head, split for loss parallel) stays one parameter
    under all its names."""
    local: dict[int, nn.Parameter] = {}
    for fqn, axes in with_ties(model, held_placements(model, plan)).items():
        owner, _, name = fqn.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        param = getattr(module, name)
        if id(param) not in local:
            shape = list(param.shape)
            for axis, placement in axes.items():
                if placement.is_shard:
                    assert placement.dim is not None, "a shard placement names its dim"
                    dim = placement.dim % len(shape)
                    shape[dim] = math.ceil(shape[dim] / plan.mesh.size(axis))
            local[id(param)] = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=param.requires_grad)
        setattr(module, name, local[id(param)])


class _Census(TorchDispatchMode):
    """``timeline``: live bytes of the tensors a meta pass creates, after every op, as (activations
    and temporaries, parameter gradients). A storage counts from the op that makes it until its last
    reference dies; a gradient moves to the second column when autograd accumulates it."""

    def __init__(self, model: nn.Module, share) -> None:
        super().__init__()
        self.share = share  # () -> the share of a new tensor this rank holds (sequence parallel)
        self.live = [0.0, 0.0]
        self.timeline: list[tuple[float, float]] = []
        self._bytes: dict[int, list[float]] = {}  # key -> [column, bytes]
        self._keys = itertools.count(1)
        for t in [*model.parameters(), *model.buffers()]:
            # The census tags each storage it counts (0: a parameter's or buffer's, never counted).
            t.untyped_storage()._census = 0  # type: ignore[attr-defined]  # our own attribute on torch's storage
        for p in model.parameters():
            if p.requires_grad:  # frozen weights (LoRA's base) get no gradient
                p.register_post_accumulate_grad_hook(self._to_grads)

    def _to_grads(self, p: torch.Tensor) -> None:
        assert p.grad is not None, "autograd calls this hook once it has accumulated the gradient"
        entry = self._bytes.get(getattr(p.grad.untyped_storage(), "_census", 0))
        if entry is not None and entry[0] == 0:
            entry[0] = 1
            self.live[0] -= entry[1]
            self.live[1] += entry[1]

    def hold(self, t: torch.Tensor, nbytes: float) -> None:
        """``nbytes`` live while autograd keeps ``t`` for backward: what a grid's or cube's Linear gathers and
        keeps beside ``t`` (its own copy of the input, its weight block), which the pass does not make."""
        self.live[0] += nbytes
        weakref.finalize(t, self._release, nbytes)

    def _release(self, nbytes: float) -> None:
        self.live[0] -= nbytes

    def _free(self, key: int) -> None:
        column, nbytes = self._bytes.pop(key)
        self.live[int(column)] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not hasattr(storage := t.untyped_storage(), "_census"):
                key = storage._census = next(self._keys)
                self._bytes[key] = [0, storage.nbytes() * self.share()]
                self.live[0] += self._bytes[key][1]
                weakref.finalize(storage, self._free, key)
        self.timeline.append((self.live[0], self.live[1]))
        return out


_GATHERED = "\0gathered"  # on the module stack: a sequence-parallel block's child that runs on the whole rows


class _Regather:
    """A sequence-parallel norm's output as the projections keep it: its shard (``output``, counted at
    1/tp), gathered whole once backward first asks (a new tensor the census counts whole), the shard
    then dropped; the gathered tensor dies with the last view saved of it, as in the engine."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output: torch.Tensor | None = output
        self.full: torch.Tensor | None = None

    def gather(self) -> torch.Tensor:
        if self.full is None:
            output = self.output
            assert output is not None, "the shard is dropped only once the whole is gathered"
            nbytes = output.untyped_storage().nbytes()
            self.full = torch.empty(nbytes // output.element_size(), dtype=output.dtype, device="meta")
            self.output = None
        return self.full


class _SavedView:
    def __init__(self, regather: _Regather, size, stride, offset: int | torch.SymInt) -> None:
        self.regather, self.size, self.stride, self.offset = regather, size, stride, offset


def _unpack(packed: torch.Tensor | _SavedView) -> torch.Tensor:
    if isinstance(packed, _SavedView):
        return packed.regather.gather().as_strided(packed.size, packed.stride, packed.offset)
    return packed


def saved_activations(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, *, model: nn.Module | None = None,
                      attention: Callable[..., torch.Tensor] = flash_attention_for_cpu) -> dict:
    """One forward and backward of ``micro_batch`` sequences on the meta device: ``{"units": {unit:
    bytes saved for backward}, "block_inputs": {block: bytes}, "timeline": [(activations and
    temporaries, gradients) after each op], "forward_ops": n, "unit_params": {unit: [fp32 bytes of
    each tp- and ep-local parameter]}, "largest_trainable": fp32 bytes of the largest parameter that trains}``
    (the last unit also holds the loss's; frozen weights, LoRA's base, get no gradient here either). ``attention``: what
    the pass runs for ``F.scaled_dot_product_attention`` (its arguments), in this thread only
    (:class:`AttentionKernel`); default :func:`flash_attention_for_cpu`, what a CPU run saves."""
    # A given model is copied: the pass gives its parameters their tp-local shapes.
    model = copy.deepcopy(model if model is not None else meta_model(cfg.model))
    _local_shapes(model, plan)
    unit_params: dict[str, list[float]] = defaultdict(list)
    trainable: list[float] = [0.0]
    ep, experts = expert_split(plan)  # the pass runs every expert; a rank holds (and FSDP gathers) 1/ep of them
    for fqn, p in model.named_parameters():
        nbytes = p.numel() * 4.0 / (ep if fqn.startswith(experts) else 1)
        unit_params[owning_unit(fqn, plan.units) or ""].append(nbytes)
        if p.requires_grad:
            trainable.append(nbytes)
    if cfg.train.precision == "bf16":
        model.to(torch.bfloat16)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    sp_norms = {name for name, layout in plan.layouts.items() if any(p.is_shard for p in layout.input.values())}
    # Each tensor-parallel axis once: a list naming an axis per placement would multiply its size as many times.
    tp = plan.mesh.size(sorted({a for axes in plan.placements.values() for a in axes}))
    current: list[str] = []
    units: dict[str, float] = defaultdict(float)
    cores: dict[str, float] = defaultdict(float)  # of units: what the attention kernel saves beyond q, k, v
    core_inputs: set[int] = set()  # while the kernel runs: its q, k, v storages (empty: not in the kernel)
    inputs: dict[str, float] = {}
    seen: set[int] = set()
    hooks = []
    # Sequence parallel: a norm's output is gathered for the projections, which keep only its shard for
    # backward and gather it again there (parallel.sharding.sequence_parallel): storage -> the output.
    sp_outputs: dict[int, weakref.ref] = {}
    regathers: weakref.WeakValueDictionary[int, _Regather] = weakref.WeakValueDictionary()
    # A sequence-parallel block keeps its residual stream as sequence shards: its own code (the residual adds)
    # and its norms run on 1/tp of the rows, its other children (attention, the MLP) on the gathered rows.
    sp_blocks = {b for b in plan.blocks if any(n.startswith(f"{b}.") for n in sp_norms)}
    # A grid's or cube's blocks (parallel.plan.split): each op at the rank's share of its block, each Linear its
    # own gathered input and weight block, each norm its normalised input too.
    layout = LayoutCensus.of(plan, model, params)
    if layout is not None:
        hooks.extend(layout.hooks(model))
        for name in layout.shares.norms:
            hooks.append(model.get_submodule(name).register_forward_hook(lambda _m, _a, out: normalised(out)))
    for name, module in model.named_modules():
        if name in plan.units or name in sp_norms:
            hooks.append(module.register_forward_pre_hook(lambda _m, args, name=name: _enter(name, args)))
            hooks.append(module.register_forward_hook(lambda *_: current.pop() and None))
        elif name.rpartition(".")[0] in sp_blocks:
            hooks.append(module.register_forward_pre_hook(lambda *_: current.append(_GATHERED)))
            hooks.append(module.register_forward_hook(lambda *_: current.pop() and None))
        if name in sp_norms:
            hooks.append(module.register_forward_hook(
                lambda _m, _a, out: sp_outputs.__setitem__(out.untyped_storage()._cdata, weakref.ref(out))))

    def _enter(name: str, args: tuple) -> None:
        current.append(name)
        if name in plan.blocks and args and isinstance(args[0], torch.Tensor):
            # Sequence parallel keeps the residual stream between blocks sequence-sharded
            # (parallel.sharding.tensor_parallel._scatter_gather_runs): a checkpointed block keeps 1/tp of its input.
            sp_block = any(n.startswith(f"{name}.") for n in sp_norms)
            inputs[name] = args[0].numel() * args[0].element_size() / (tp if sp_block else 1)
            if layout is not None and name in layout.shares.blocks:
                inputs[name] *= layout.shares.block

    def keep(nbytes: float) -> None:  # saved for backward by the unit running
        units[next((c for c in current if c in plan.units), plan.units[-1])] += nbytes

    def normalised(out: torch.Tensor) -> None:  # a grid's or cube's norm keeps its normalised input too
        assert layout is not None, "hooked for a grid's or cube's norms only"
        keep(nbytes := layout.normalised(out))
        census.hold(out, nbytes)

    def share(t: torch.Tensor | None = None) -> float:
        # a grid's or cube's block: the rank's share; sequence parallel: a norm and the residual stream run on
        # this rank's sequence shard
        if layout is not None and (split := layout.share(t, core=bool(core_inputs))) is not None:
            return split
        for c in reversed(current):
            if c == _GATHERED:
                return 1.0
            if c in sp_norms or c in sp_blocks:
                return 1 / tp
        return 1.0

    def pack(t: torch.Tensor) -> torch.Tensor | _SavedView:
        storage = t.untyped_storage()
        output = sp_outputs.get(storage._cdata)
        gathered = output is not None and output() is not None
        if layout is not None and (counted := layout.linear_saved(t)) is not None:
            keep(counted)  # a grid's or cube's Linear: its own gathered input and weight block
            if counted:
                census.hold(t, counted)
            return t
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            owner = next((c for c in current if c in plan.units), plan.units[-1])
            units[owner] += storage.nbytes() * (1 / tp if gathered else share(t))
            if core_inputs and storage._cdata not in core_inputs:
                cores[owner] += storage.nbytes() * share(t)
        if not gathered:
            return t
        regather = regathers.get(storage._cdata) or regathers.setdefault(storage._cdata, _Regather(t))
        return _SavedView(regather, t.size(), t.stride(), t.storage_offset())

    def counted(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def core(q, k, v, *args, **kwargs):
            core_inputs.update(t.untyped_storage()._cdata for t in (q, k, v))
            try:
                return kernel(q, k, v, *args, **kwargs)
            finally:
                core_inputs.clear()
        return core

    seq = cfg.train.seq_len // plan.cp_size  # a cp rank holds 1/cp of every row
    if isinstance(cfg.model, MLPConfig):  # regression: features in, predictions out
        x = torch.empty(micro_batch, cfg.model.in_features, device="meta")
        y = torch.empty(micro_batch, cfg.model.out_features, device="meta")
    else:
        x = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
        y = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    census = _Census(model, share)
    # Every device runs the fused ring (parallel.context.ring): q, k, v, the output and log-sum-exp kept.
    with AttentionKernel(counted(_over_the_row(attention, plan, memory=True))), census:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = model(x)
            # A tp-local output (Partial / Shard) has no loss here: its sum stands in for backward.
            loss = (loss_fn_for(cfg.model, chunk_tokens=cfg.train.loss_chunk_tokens)(out, y)
                    if out.shape == y.shape or out.shape[:-1] == y.shape else out.sum())
            # The engine passes the output straight to the loss (ParallelModel.forward_backward): nothing holds the
            # logits in backward unless the loss saved them (measured: tp [4], 32k vocabulary, 2048 tokens, 256 MiB
            # of fp32 logits counted here in backward beside a measured peak that had none, bench_loss_memory.py).
            del out
        forward_ops = len(census.timeline)
        if loss.requires_grad:
            loss.backward()
    for hook in hooks:
        hook.remove()
    return {"units": dict(units), "cores": dict(cores), "block_inputs": inputs, "timeline": census.timeline,
            "forward_ops": forward_ops,
            "unit_params": dict(unit_params), "largest_trainable": max(trainable)}
