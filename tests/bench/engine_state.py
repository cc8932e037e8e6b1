"""What the engine that trained a published row keeps beside its activations, where that differs from this
engine's: a published peak is compared with the engine that made it (as :func:`bench_profiles.row_model`
does for the gated unit's saved tensors).

nanotron (huggingface/nanotron at 2411b022; its scaling benchmarks set ``accumulate_grad_in_fp32``), per
tp- and pp-local parameter ``N``:

* bf16 weights, ``2 N`` (the model in the training dtype);
* ``FP32GradientAccumulator`` (``src/nanotron/optim/gradient_accumulator.py``): an fp32 copy of the weights
  the optimizer updates (under ZeRO-1 only this dp rank's slice: ``ZeroDistributedOptimizer`` builds the
  accumulator over the sliced parameters, ``helpers.py`` ``init_optimizer_and_grad_accumulator``) and fp32
  gradient buffers for every parameter, "even when Zero 1 is used" (its docstring): ``4 N / dp`` (ZeRO-1) or
  ``4 N``, and ``4 N``;
* AdamW's two fp32 moments of the weights the optimizer holds: ``8 N / dp`` (ZeRO-1) or ``8 N``;
* with dp > 1, torch DDP (``trainer.py``, ``DistributedDataParallel(model, ...)``) and its gradient buckets
  in the weights' dtype: ``2 N``.

This engine instead keeps fp32 weights and gradients whole and fp32 moments sharded over dp (its ``zero1``;
ddp: all whole) beside a bf16 copy of the weights: the rows' state is replaced here by nanotron's, the activations,
backward's transient and the allocator's slack kept as predicted.
"""

from __future__ import annotations

from trainer.planner.memory.predict import MemoryEstimate

ENGINE_STATE = ("nanotron",)  # rows whose engine's weights, gradients and optimizer state are modelled here


def nanotron_state_bytes(params: int, dp: int, zero1: bool) -> float:
    """The bytes of weights, gradients and optimizer state a nanotron rank holds for ``params`` local parameters."""
    shard = dp if zero1 else 1
    buckets = 2.0 * params if dp > 1 else 0.0
    return 2.0 * params + 4.0 * params / shard + 4.0 * params + 8.0 * params / shard + buckets


def reserved_as_published(estimate: MemoryEstimate, params: int, dp: int, zero1: bool) -> float:
    """What a nanotron rank's allocator holds at the peak: its own state beside this engine's predicted
    activations (and backward's transient, the optimizer step's temporaries, the caching allocator's slack)."""
    p = estimate.parts
    peak = max(estimate.activations + p.transient, p.step_temporaries)
    return nanotron_state_bytes(params, dp, zero1) + peak + p.allocator
