"""The memory plan: activations counted per schedule and mode, a budget that refuses before any
worker starts (naming the fix), and the meter that measures what a run used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parallel.errors import ConfigError
from tests.conftest import run_cli
from trainer.config.compose import compose_dict
from trainer.planner.memory.predict import predict_memory
from trainer.planner.numbers import GIB
from trainer.validate.checks import validate_config, validate_with_plan
from timing import scaled


def _predict(*overrides: str):
    cfg, plan = validate_with_plan(compose_dict([*overrides, "tracking=none"]))
    return predict_memory(cfg, plan)


def test_activations_scale_with_the_batch_and_shrink_with_checkpointing():
    (one,) = _predict("model=gpt_small", "train.global_batch_size=8")
    (two,) = _predict("model=gpt_small", "train.global_batch_size=16")
    assert two.activations == pytest.approx(2 * one.activations, rel=1e-2)  # (batch-independent tables aside)
    assert two.params == one.params and two.optimizer == 2 * two.params
    (full,) = _predict("model=gpt_small", "+parallel=fsdp", "mesh=[2]", "+parallel.activation_checkpointing=full")
    (none,) = _predict("model=gpt_small", "+parallel=fsdp", "mesh=[2]")
    assert full.activations < none.activations / 2
    (half,) = _predict("model=gpt_small", "train.precision=bf16")
    assert half.activations < 0.7 * two.activations  # bf16 activations (the loss's fp32 logits stay)


def test_schedules_hold_the_micro_batches_they_keep_in_flight():
    gpipe = _predict("+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=GPipe", "parallel.pipeline.microbatches=4")
    one_f_one_b = _predict("+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=1F1B",
                           "parallel.pipeline.microbatches=4")
    assert [e.in_flight for e in gpipe] == [4, 4]
    assert [e.in_flight for e in one_f_one_b] == [2, 1]  # pp - rank: warm-up forwards, then one in, one out
    assert gpipe[0].activations == pytest.approx(2 * one_f_one_b[0].activations)


def test_tensor_and_sequence_parallel_shrink_activations():
    (single,) = _predict("model=gpt_small")
    (tp,) = _predict("model=gpt_small", "+parallel=tp", "mesh=[2]")
    (sp,) = _predict("model=gpt_small", "+parallel=tp_sp", "mesh=[2]")
    assert sp.activations < tp.activations < single.activations


def test_fsdp_heap_holes_do_not_shrink_with_the_ranks():
    # FSDP's flat buffers are a whole block's on any number of ranks, so the holes they leave stay
    # while the live tensors shrink: the reason measured fsdp [8] peaks sat far above 1/4 of fsdp [2]'s.
    (two,) = _predict("model=gpt_small", "+parallel=fsdp", "mesh=[2]")
    (eight,) = _predict("model=gpt_small", "+parallel=fsdp", "mesh=[8]")
    assert eight.live < two.live / 2
    # beside them, the holes of the step's activations (larger flat buffers fit in none of those):
    # these shrink with the batch each rank runs
    from trainer.planner.memory.host import STEP_FRAGMENTATION

    def flat_holes(e):
        return e.parts.allocator - STEP_FRAGMENTATION * e.parts.step_activations

    assert flat_holes(eight) == pytest.approx(flat_holes(two), rel=0.01)
    assert eight.parts.step_activations == pytest.approx(two.parts.step_activations / 4, rel=0.05)
    (single,) = _predict("model=gpt_small")
    assert single.parts.allocator < two.parts.allocator  # one process: only the step's own holes


def test_a_config_over_its_budget_is_refused_with_the_fix():
    overrides = ["model=gpt_small", "+parallel=fsdp", "mesh=[2]", "tracking=none"]
    cfg, plan = validate_with_plan(compose_dict(overrides))
    peak = max(e.total for e in predict_memory(cfg, plan))
    with pytest.raises(ConfigError) as err:
        validate_config(compose_dict([*overrides, f"launch.memory_budget_gb={0.9 * peak / GIB}"]))
    (issue,) = err.value.issues
    assert issue.path == "launch.memory_budget_gb"
    assert "exceeds the budget" in issue.reason and "activations" in issue.reason
    assert "parallel.activation_checkpointing=full" in issue.fix  # predicted to fit: checkpointing frees the most


def test_the_cli_refuses_before_any_worker_starts(tmp_path):
    out = run_cli(["+parallel=fsdp", "mesh=[2]", "launch.memory_budget_gb=0.001", "tracking=none"], cwd=tmp_path,
                  timeout=scaled(120))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "launch.memory_budget_gb" in text and "exceeds the budget" in text
    assert "workers:" not in text  # the launcher never ran


def test_meter_counts_what_the_process_allocated_after_it_was_made():
    # In a fresh process, as a worker's meter runs: in this long-lived one the allocator may serve the
    # block from memory that earlier tests left resident, and the resident size would not grow.
    code = ("import torch; from trainer.run.metrics import MemoryMeter; meter = MemoryMeter(torch.device('cpu')); "
            "block = torch.ones(64 * 2**20 // 4); print(meter.peak_mb())")  # 64 MiB, touched
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert 60 <= float(out.stdout.split()[-1]) <= 120


def test_a_pipelined_fsdp_stage_holds_every_blocks_unsharded_gradients():
    # torch's PipelineStage runs each micro-batch's backward with FSDP's gradient sync and resharding
    # off and reduce-scatters the whole stage after the last one: the stage's unsharded parameters
    # and gradients (fp32 here) are there with the activations in flight; the reduce adds one block's
    # fp32 reduce-scatter input once those are freed. gpt_small (dim 512, SwiGLU 1376, byte vocab)
    # on dp x pp x tp [2, 2, 2]: 4 blocks a stage, Megatron-split over tp, the embedding's vocabulary rows too.
    dim, ffn, vocab = 512, 1376, 256
    block = 4 * (4 * dim * dim // 2 + 3 * dim * ffn // 2 + 2 * dim)  # tp-local fp32 bytes of one block
    first, last = _predict("model=gpt_small", "+parallel=3d", "mesh=[2,2,2]")
    local = 4 * block + 4 * vocab * dim // 2  # pp rank 0: 4 blocks and half the embedding's rows
    assert block == 6_328_320
    assert first.gathered == local == 25_575_424
    # 4 micro-batches, 2 in flight on pp rank 0: 1F1B's steady state holds 2 passes beside all the gradients
    assert first.in_flight == 2 and first.parts.stage_grads == local
    assert first.parts.reduce == 2 * local + block
    assert not first.parts.accumulates  # no sharded gradients beside the activations
    backward = first.gathered + first.activations + first.parts.transient + first.parts.stage_grads
    assert first.live == first.params + first.optimizer + backward
    # The workers' fork server preloads what torch.distributed.pipelining imports (torch._dynamo,
    # _inductor): a pipeline's runtime is any distributed layout's, alone or beside fsdp and tp
    (flat,) = _predict("model=gpt_small", "+parallel=2d", "mesh=[2,2]")
    alone = _predict("model=gpt_small", "+parallel=pp", "mesh=[2]")
    assert first.parts.runtime == flat.parts.runtime == alone[0].parts.runtime == 24 * 2**20


def test_a_stage_peaks_with_its_passes_in_flight_or_its_first_gradients():
    # pp rank 0 of 1F1B with as many micro-batches as stages runs every forward before its first
    # backward: the peak is all passes or one pass fewer beside the gradients that backward made,
    # whichever is more; with more micro-batches the steady state holds all passes and gradients.
    def rank0(*overrides):
        return _predict("model=gpt_small", "+parallel=pp", "mesh=[2]", "train.global_batch_size=16", *overrides)[0]
    m2 = rank0("parallel.pipeline.microbatches=2")
    m4 = rank0("parallel.pipeline.microbatches=4")
    assert m2.in_flight == m4.in_flight == 2
    per_pass = m2.parts.step_activations / 2  # the step's 2 passes on this rank
    grads = m2.grads  # no data parallelism: param.grad accumulates in place
    assert m2.activations + m2.parts.stage_grads == pytest.approx(max(2 * per_pass, per_pass + grads))
    per_pass4 = m4.parts.step_activations / 4
    assert m4.activations == pytest.approx(2 * per_pass4) and m4.parts.stage_grads == m4.grads
    # heap holes: at least STEP_FRAGMENTATION of all the activations the step allocates (CPU, default heap)
    assert m4.parts.allocator >= 0.6 * m4.parts.step_activations
    unmapped = rank0("parallel.pipeline.microbatches=4", "launch.unmap_freed_memory=true")
    assert unmapped.parts.allocator == 0.0


def test_ddp_holds_an_unsharded_copy_and_reduces_through_two_flat_buffers():
    # ddp is FSDP2's replicate with the whole model one parameter group: an unsharded copy of every
    # parameter from forward to the end of backward, then the gradients copied into one flat fp32
    # buffer and all-reduced into a second. On CPU both sit on top of backward's peak (its freed
    # tensors stay resident as heap holes); with the model's bytes from 32 MiB up glibc maps them
    # on their own, so they leave no holes behind.
    (single,) = _predict("model=gpt_small")
    (ddp,) = _predict("model=gpt_small", "+parallel=dp", "mesh=[2]")
    local = single.params  # every rank holds the whole model: gpt_small, 26M fp32 parameters
    assert local > 32 * 2**20
    assert ddp.params == local and ddp.gathered == local
    backward = ddp.gathered + ddp.activations + ddp.parts.transient
    assert ddp.parts.reduce == pytest.approx(backward + 2 * local)
    assert ddp.live == pytest.approx(ddp.params + ddp.optimizer + ddp.parts.reduce)  # the reduce is the peak
    (fsdp,) = _predict("model=gpt_small", "+parallel=fsdp", "mesh=[2]")
    assert fsdp.parts.reduce == 0.0  # FSDP reduces block by block, inside backward
    (half,) = _predict("model=gpt_small", "+parallel=dp", "mesh=[2]", "train.precision=bf16")
    assert half.gathered == local / 2  # a bf16 copy; the flat buffers stay fp32
    assert half.parts.reduce == pytest.approx(half.gathered + half.activations + half.parts.transient + 2 * local)
    # a pipelined ddp stage accumulates its unsharded gradients over the micro-batches and reduces once,
    # after its last: on CPU the two flat buffers extend the heap above backward's peak
    pp_ddp = ["model=gpt_small", "+parallel=pp", "+parallel.data_parallel={dim: dp, mode: ddp}",
              "parallel.dims=[dp,pp]", "mesh=[2,2]"]
    for e in _predict(*pp_ddp):
        assert e.gathered == e.params and e.parts.stage_grads == e.params
        backward = e.gathered + e.activations + e.parts.transient + e.parts.stage_grads
        assert e.parts.reduce == pytest.approx(backward + 2 * e.params)
    for e in _predict(*pp_ddp, "launch.unmap_freed_memory=true"):  # the unsharded gradients and one flat buffer
        assert e.parts.reduce == 2 * e.params


_HOLES = """
import sys, torch
from trainer.planner.memory.host import unmap_freed_memory
if sys.argv[1] == "unmap":
    unmap_freed_memory()
rss = lambda: next(float(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
torch.ones(512 * 1024)  # a freed 2 MiB mapping: glibc's dynamic threshold rises to it
before = rss()
keep, scratch = [], []
for _ in range(200):  # 1 MiB activations freed between small survivors: heap holes unless unmapped
    scratch.append(torch.ones(256 * 1024))
    keep.append(torch.ones(16 * 1024))  # 64 KiB: from the heap in either mode
del scratch
print(rss() - before)
"""


@pytest.mark.parametrize("mode, most", [("unmap", 20), ("default", None)])
def test_unmapped_memory_leaves_no_heap_holes(mode, most):
    out = subprocess.run([sys.executable, "-c", _HOLES, mode], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    resident = float(out.stdout.split()[-1])
    if most is not None:
        assert resident < most  # the 200 MiB came back to the system
    else:
        assert resident > 150  # glibc's dynamic threshold kept them in the heap, resident


def test_unmapping_drops_the_heap_terms_from_the_plan(monkeypatch):
    base = ("model=gpt_small", "+parallel=fsdp", "mesh=[8]")
    (heap,) = _predict(*base)
    (unmapped,) = _predict(*base, "launch.unmap_freed_memory=true")
    assert heap.parts.allocator > 0 and unmapped.parts.allocator == 0.0
    assert unmapped.total == unmapped.live + unmapped.parts.runtime
    (ddp,) = _predict("model=gpt_small", "+parallel=dp", "mesh=[2]", "launch.unmap_freed_memory=true")
    assert ddp.parts.reduce == 2 * ddp.params  # backward's freed memory is returned: two flat buffers
    import trainer.validate.launch_checks as validate

    monkeypatch.setattr(validate, "has_mallopt", lambda: False)
    with pytest.raises(ConfigError) as err:
        validate_config(compose_dict(["launch.unmap_freed_memory=true", "tracking=none"]))
    assert "launch.unmap_freed_memory" in str(err.value) and "set launch.unmap_freed_memory=false" in str(err.value)
