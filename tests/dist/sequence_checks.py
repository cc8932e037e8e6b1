"""What sequence parallelism keeps for backward, measured inside the workers of a launch (``dist_harness``).

:func:`saved_bytes_check` runs one forward and backward of the built-in decoder under tp [2] with
sequence parallelism, twice from the same weights: with the engine's default (a gathered norm output
kept as its sequence shard and gathered again in backward) and with the gathered tensor kept whole
(``apply_placements(regather=False)``). A saved-tensor hook around the forward counts, per block, the
bytes of every storage autograd keeps (parameters aside); a ``CommDebugMode`` counts the collectives
of forward and of backward. The parent test compares the two runs with numbers computed by hand. A
third run splits backward as the zero-bubble pipeline schedules do (torch's ``stage_backward_input``, then
``stage_backward_weight`` over the graph it retained), from the embeddings' output as the stage's input.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from parallel.mesh import build_mesh
from parallel.plan.resolve import resolve_plan
from parallel.sharding.tensor_parallel import apply_placements
from trainer.models import build_model, loss_fn_for


def _saved_per_block(model: torch.nn.Module, blocks: list[str]):
    """A saved-tensor hook that adds the bytes of each storage autograd keeps to the block running
    (``""`` outside blocks); parameters aside. Returns ``(hooks, per_block)``."""
    per_block: dict[str, int] = {}
    seen: set[int] = set()
    current: list[str] = []
    for name in blocks:
        block = model.get_submodule(name)
        block.register_forward_pre_hook(lambda _m, _a, name=name: current.append(name))
        block.register_forward_hook(lambda *_: current.pop() and None, always_call=True)

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and storage._cdata not in seen:
            seen.add(storage._cdata)
            where = current[-1] if current else ""
            per_block[where] = per_block.get(where, 0) + storage.nbytes()
        return t.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), per_block


def _split_backward(model: torch.nn.Module, loss: torch.Tensor, stage_input: torch.Tensor) -> None:
    """Input gradients first (the graph retained), then the weights' from the intermediates it kept."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    _, param_groups = stage_backward_input([loss], None, [stage_input], model.parameters())
    stage_backward_weight(model.parameters(), param_groups)


def _run(regather: bool, split: bool = False) -> dict:
    from dist_checks import batches, llama_cfg, load_preset  # dist_checks imports this module for its SUITES

    cfg = llama_cfg()
    mesh_shape, par = load_preset("tp_sp")
    # The head's logits whole (no loss parallel): a plain loss on the model's output, no engine around it.
    par = par.model_copy(update={"tensor_parallel": par.tensor_parallel.model_copy(update={"loss_parallel": False})})
    model = build_model(cfg, seed=0)
    plan = resolve_plan(par, mesh_shape, model)
    apply_placements(model, build_mesh(mesh_shape, list(par.dims)), placements=plan.placements, layouts=plan.layouts,
                     regather=regather)
    blocks = [f"layers.{i}" for i in range(cfg.n_layers)]
    hooks, per_block = _saved_per_block(model, blocks)
    stage_input: list[torch.Tensor] = []
    if split:  # the embeddings' output as a pipeline stage's input
        model.tok_embeddings.register_forward_hook(lambda _m, _a, out: stage_input.append(out.detach().requires_grad_())
                                                   or stage_input[0])
    inputs, targets = batches(cfg)[0]
    with CommDebugMode() as forward_comm, hooks:
        loss = loss_fn_for(cfg)(model(inputs), targets)
    with CommDebugMode() as backward_comm:
        _split_backward(model, loss, stage_input[0]) if split else loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()
             if p.grad is not None}
    return {"saved": per_block, "loss": float(loss.detach()), "grads": grads,
            "forward_comm": {str(k): v for k, v in forward_comm.get_comm_counts().items()},
            "backward_comm": {str(k): v for k, v in backward_comm.get_comm_counts().items()}}


def saved_bytes_check(*, rank: int, world_size: int) -> dict:
    from dist_checks import batches, llama_cfg  # dist_checks imports this module for its SUITES

    kept, regathered = _run(regather=False), _run(regather=True)
    reference = build_model(llama_cfg(), seed=0)
    inputs, targets = batches(llama_cfg())[0]
    loss_fn_for(llama_cfg())(reference(inputs), targets).backward()

    def max_rel(grads) -> float:
        return max(float((grads[n] - p.grad).norm() / p.grad.norm()) for n, p in reference.named_parameters())

    split = _run(regather=True, split=True)
    return {"kept": {k: v for k, v in kept.items() if k != "grads"},
            "regathered": {k: v for k, v in regathered.items() if k != "grads"},
            "split": {k: v for k, v in split.items() if k != "grads"},
            "grads_bitwise_equal": all(torch.equal(kept["grads"][n], regathered["grads"][n]) for n in kept["grads"]),
            "grad_max_rel_to_one_device": max_rel(regathered["grads"]),
            "split_grads": sorted(split["grads"]),
            "split_grad_max_abs_diff": max(float((g - regathered["grads"][n]).abs().max()) for n, g in split["grads"].items())}
