"""torch.compile per transformer block, as torchtitan does it.

    apply_compile(model, block_fqns=["layers.0", "layers.1", "layers.2", "layers.3"])
    # each block's forward becomes one Inductor graph; the model is changed in place

Where it goes: after tensor parallelism and activation checkpointing, before data parallelism
(the engine's order, torchtitan's too). The blocks are compiled one by one, not the model:
every block runs the same code, so Dynamo traces it once and reuses the graph for the others
(one for training, one for the no-grad forward of evaluation), and the parts around the blocks
(embedding, head, loss, the pipeline schedule, FSDP's root) stay eager.

Why ``block.compile()`` and not ``torch.compile(block)``:

* **Names.** ``torch.compile(block)`` returns an ``OptimizedModule`` wrapper; put back in the
  parent, every parameter name gains an ``_orig_mod`` segment (``layers.0._orig_mod.attn.wq.weight``),
  which DCP's ``get_state_dict`` strips but placements, pipeline FQNs, ``named_parameters`` and
  the Hugging Face and safetensors exports would all see. ``nn.Module.compile`` compiles the
  module's own call in place: the module tree, the parameter names and every state-dict key are
  exactly those of the eager model, so a checkpoint written by a compiled run loads into an
  eager one and back.
* **Hooks.** Dynamo does not trace ``nn.Module._call_impl`` itself; it compiles the frames it
  calls. The block's ``forward`` (its submodules, their tensor-parallel input/output hooks and
  the DTensor redistributions inlined) becomes one graph. FSDP2's hooks on the block (all-gather
  before, reshard after: ``fully_shard`` comes later and registers them on the same module) are
  marked ``torch._dynamo.disable`` and run eagerly, as they would around a wrapper; other hooks
  on the block itself (sequence parallelism's scatter and gather on the first and last block)
  become small graphs of their own.
* ``fullgraph=True`` (torchtitan's choice): a graph break inside a block is an error at the first
  step, not a silent slowdown.
* **Activation checkpointing.** A checkpointed block is a ``CheckpointWrapper``; the block inside
  it is compiled and the checkpoint stays eager: the compiled forward's saved activations pass
  through the checkpoint's saved-tensor hooks, are dropped, and the compiled forward runs again in
  backward to recompute them. Compiling the wrapper instead (Dynamo then traces the checkpoint as
  a higher-order op) fails in torch 2.13 with tensor parallelism: the op refuses the column-
  parallel layers' shared input conversion (a side effect inside it), and with sequence
  parallelism AOTAutograd finds a ``DeviceMesh`` among the tensors saved for backward.

Zero-bubble pipeline schedules (``InterleavedZeroBubble``, ``ZBV``) do not compose with it and
are refused (by the trainer's validator before launch, by :func:`parallel.engine.parallelize` for
a direct caller): they split each backward into an input-gradient pass and a weight-gradient pass
over the autograd graph, but a compiled block is one autograd node, so the weight pass re-runs
the block's whole backward; and the first pass retains the graph, which AOTAutograd's donated
buffers forbid. Turning those off (``torch._functorch.config.donated_buffer = False``) is not
enough in torch 2.13: Inductor's FX graph cache key leaves out the donated buffers, so a backward
compiled earlier with donation (any earlier run of the same block) is served again, and the
retained graph's second pass reads overwritten activations: wrong gradients, silently.

A module without blocks (the ``mlp`` arch: raw parameters, no repeated blocks) is compiled
whole. Inductor generates C++ on CPU, so a C++ compiler must be installed: the trainer's
validator refuses ``train.compile=true`` without one. Losses equal eager ones within fp32
rounding (Inductor may fuse and reorder float arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper


def apply_compile(module: nn.Module, *, block_fqns: Sequence[str], fullgraph: bool = True) -> list[str]:
    """Compile each block of ``module`` (the model or a pipeline stage) named in ``block_fqns``
    in place with ``nn.Module.compile``; returns the FQNs compiled (``[""]`` for the whole module).

    Args:
        module: the model or one pipeline stage, after tensor parallelism and activation
            checkpointing, before data parallelism.
        block_fqns: the repeated blocks (``plan.blocks``, e.g. ``layers.0`` ..); those absent
            from ``module`` (another pipeline stage holds them) are skipped. Empty: the model
            has no blocks and ``module`` is compiled whole.
        fullgraph: refuse graph breaks inside a block (default ``True``, as torchtitan).
    """
    if not block_fqns:
        module.compile(fullgraph=fullgraph)
        return [""]
    modules = dict(module.named_modules())
    compiled = []
    for fqn in block_fqns:
        if fqn in modules:
            block = modules[fqn]
            # Inside an activation-checkpointing wrapper: the checkpoint stays eager (see above).
            block = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
            block.compile(fullgraph=fullgraph)
            compiled.append(fqn)
    return compiled
