"""Real multi-process checks of the distribution engine on CPU (gloo): loss parity with one
device for every preset in conf/parallel, placements on every rank, pipeline FQNs, the seeds'
MLP through DTensor propagation, and hsdp on a mesh of explicit rank ids in any order.

    pytest tests/dist -q          # about 2 minutes on 2 cores

Three launches in all (2, 4 and 8 processes), each running many checks in one process group;
see ``dist_checks.SUITES``. The single-device reference runs in this (parent) process.
"""

from __future__ import annotations

import pytest

from dist_checks import MLP_CFG, STEPS, SUITES, llama_cfg, masked_loss, masked_targets, reference_run
from dist_harness import launch
from trainer.models import build_model


WORLD_SIZE = {"two_rank": 2, "four_rank": 4, "eight_rank": 8}
SUITE_OF = {name: suite for suite, checks in SUITES.items() for name, _ in checks}
LOSS_REL_TOL = 1e-5
PARITY_CHECKS = [name for name in SUITE_OF
                 if name not in ("tp_comm", "tp_sp_comm", "tp_sp_saved", "hf_2d_logits") and not name.startswith("bf16")]
BF16_CHECKS = [name for name in SUITE_OF if name.startswith("bf16")]
# bf16 against one device's bf16 (autocast): not bit for bit, because the bf16 roundings differ by
# layout: FSDP2's policy computes whole blocks in bf16 where autocast casts only the matmuls, and
# tensor parallelism adds partial products in another order before rounding. Measured over the 5
# steps: max rel 2.5e-5 (dp, fsdp), 1.9e-5 (tp), 4.1e-6 (pp), 3.8e-5 (2d, 3d), against fp32's 0.
# (These near-uniform losses move little under bf16 at all, 4.3e-5 from fp32, so the checks also
# see bf16 at work: every Linear's output is bf16 while the weights stay fp32.)
BF16_REL_TOL = 2e-4
PRESET_CHECKS = ["dp", "fsdp", "zero2", "tp", "tp_sp", "pp_GPipe", "pp_1F1B", "pp_Interleaved1F1B",
                 "pp_InterleavedZeroBubble", "pp_ZBV", "hsdp", "2d", "3d",
                 "pp_1F1B_grad_accum", "tp_sp_grad_accum", "fsdp_pp_grad_accum", "hsdp_rank_ids"]
_launched: dict[str, list[dict]] = {}


@pytest.fixture(scope="module", autouse=True)
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face Llama for the checks that load one; its path reaches the workers by env."""
    import os

    from tests.hf_assets import write_tiny_llama

    paths = {}
    for kind in ("llama", "qwen2", "qwen3"):
        paths[kind] = tmp_path_factory.mktemp(f"{kind}-tiny")
        write_tiny_llama(paths[kind], model_type=kind)
        os.environ[f"MESHFLOW_TEST_{kind.upper()}_DIR"] = str(paths[kind])
    yield paths
    for kind in paths:
        os.environ.pop(f"MESHFLOW_TEST_{kind.upper()}_DIR", None)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(check) -> [per-rank dict]``; each suite is launched once, when first needed."""

    def get(check: str) -> list[dict]:
        suite = SUITE_OF[check]
        if suite not in _launched:
            _launched[suite] = launch(suite, world_size=WORLD_SIZE[suite], out_dir=tmp_path_factory.mktemp(suite))
        per_rank = [r[check] for r in _launched[suite]]
        errors = [r["error"] for r in per_rank if not r["ok"]]
        assert not errors, errors[0]
        return per_rank

    return get


@pytest.fixture(scope="module")
def reference():
    return {"llama": reference_run(llama_cfg()), "mlp": reference_run(MLP_CFG),
            "llama_bf16": reference_run(llama_cfg(), precision="bf16"),
            # The chat data's masked loss, unchunked: what chunked loss-parallel layouts must give.
            "llama_masked": reference_run(llama_cfg(), loss_fn=masked_loss(), targets_of=masked_targets)}


def _max_rel(values, expected) -> float:
    return max(abs(v - e) / abs(e) for v, e in zip(values, expected, strict=True))


@pytest.mark.parametrize("check", PARITY_CHECKS)
def test_loss_parity(check, results, reference):
    """5 AdamW steps (global batch 8 x 32 tokens, grad clip 1.0) give the single-device losses
    and gradient norms, and every rank reports the same loss."""
    per_rank = results(check)
    ref = reference["mlp" if check.startswith("mlp") else "llama_masked" if "masked" in check else "llama"]
    losses = per_rank[0]["losses"]
    assert all(r["losses"] == losses for r in per_rank), "ranks disagree on the reduced loss"
    assert _max_rel(losses, ref["losses"]) <= LOSS_REL_TOL, (losses, ref["losses"])
    for r in per_rank:
        assert _max_rel(r["grad_norms"], ref["grad_norms"]) <= LOSS_REL_TOL, (r["grad_norms"], ref["grad_norms"])
    # Forward only (ParallelModel.evaluate: the pipeline schedules' eval, no gradients) after training.
    if check != "pp_ZBV":  # refused by the validator with a validation split
        assert all(r["eval_loss"] == per_rank[0]["eval_loss"] for r in per_rank)
        assert _max_rel([per_rank[0]["eval_loss"]], [ref["eval_loss"]]) <= LOSS_REL_TOL


@pytest.mark.parametrize("check", BF16_CHECKS)
def test_bf16_loss_parity(check, results, reference):
    """train.precision=bf16 on a mesh gives one device's bf16 losses to BF16_REL_TOL, every
    rank the same, while the weights (the optimizer's) stay fp32; and bf16 is not fp32."""
    per_rank = results(check)
    ref, fp32 = reference["llama_bf16"]["losses"], reference["llama"]["losses"]
    losses = per_rank[0]["losses"]
    assert all(r["losses"] == losses for r in per_rank)
    assert _max_rel(losses, ref) <= BF16_REL_TOL, (losses, ref)
    assert ref != fp32 and losses != fp32
    assert all(dtype == "torch.float32" for r in per_rank for dtype in r["param_dtypes"])
    assert all(r["linear_output_dtypes"] == ["torch.bfloat16"] for r in per_rank), [r["linear_output_dtypes"] for r in per_rank]


def test_single_device_is_plain(results, reference):
    per_rank = results("single_device")
    assert all(r["mesh_is_none"] for r in per_rank)
    assert per_rank[0]["losses"] == reference["llama"]["losses"]


@pytest.mark.parametrize("check", PRESET_CHECKS)
def test_placements_match_config(check, results):
    """Every parameter's placements per mesh axis and local shard shape are the config's
    (plus FSDP's dim-0 shard over dp), and the gathered values are the single-device init."""
    for rank, r in enumerate(results(check)):
        assert r["placement_errors"] == [], f"rank {rank}: {r['placement_errors'][:3]}"


@pytest.mark.parametrize("check", PRESET_CHECKS)
def test_stages_keep_full_model_fqns(check, results):
    """The union of the ranks' parameter names is the full model's; a pipeline splits them."""
    full = sorted(n for n, _ in build_model(llama_cfg(), device="meta").named_parameters())
    per_rank = results(check)
    assert sorted(set().union(*(r["fqns"] for r in per_rank))) == full
    if "pp" in check or check == "3d":
        assert all(len(r["fqns"]) < len(full) for r in per_rank)


def test_pipeline_stage_assignment(results):
    assert [r["stages"] for r in results("pp_1F1B")] == [[0], [1]]
    assert [r["stages"] for r in results("pp_Interleaved1F1B")] == [[0, 2], [1, 3]]  # loop style
    assert [r["stages"] for r in results("pp_ZBV")] == [[0, 3], [1, 2]]  # V style
    # 3d: [dp, pp, tp] = [2, 2, 2]; boundaries [layers.2].
    per_rank = results("3d")
    assert [r["stages"] for r in per_rank] == [[0], [0], [1], [1], [0], [0], [1], [1]]
    assert "layers.2.attn.wq.weight" in per_rank[2]["fqns"] and "layers.1.attn.wq.weight" not in per_rank[2]["fqns"]


def test_tensor_parallel_styles(results):
    report = results("tp")[0]["report"]
    assert {k for k, v in report.items() if v == "colwise"} == {
        f"layers.{i}.{m}" for i in range(4) for m in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")}
    assert {k for k, v in report.items() if v == "rowwise"} == {
        f"layers.{i}.{m}" for i in range(4) for m in ("attn.wo", "mlp.w2")}
    assert results("tp")[0]["norm_input_local_shape"] == [8, 32, 64]


def test_tensor_parallel_all_reduces_once_per_pair_and_direction(results):
    # Megatron: per block 2 all-reduces forward (after wo, w2) and 2 backward (one per column
    # group: wq/wk/wv summed, w1/w3 summed); 4 blocks. Loss parallel adds 4: the cross-entropy's max, sum of
    # exponentials and target logit over the vocabulary shards, and the column-parallel head's input gradient;
    # and 1: the vocabulary-parallel embedding's lookups summed over tp (its weight gradient stays local).
    for per_rank in results("tp_comm"):
        assert {k: v for k, v in per_rank["counts"].items() if "all_reduce" in k} == {"c10d_functional.all_reduce": 21}, per_rank


def test_sequence_parallel_gathers_and_scatters_once_per_norm_and_row(results):
    # 4 blocks, each 2 norms (gathered) and 2 row-parallel outputs (reduce-scattered). Forward: 8 gathers,
    # 8 scatters, the run's output gathered (1). Backward: the rows' gradients gathered (8), the norms'
    # scattered (8), the run's input scatter's gradient gathered (1), and each norm's output gathered again
    # for the projections' weight gradients (8, one per norm, not one per projection). Loss parallel: 4, and
    # the vocabulary-parallel embedding's lookups summed (1).
    for per_rank in results("tp_sp_comm"):
        assert per_rank["counts"] == {"c10d_functional.all_gather_into_tensor": 9 + 17,
                                      "c10d_functional.reduce_scatter_tensor": 16, "c10d_functional.all_reduce": 5}


def test_sequence_parallel_norm_gradients_are_reduced_once_per_step(results):
    # The 8 sequence-parallel norm weights get Partial gradients (each rank saw half the sequence):
    # summed once before clipping, not again by every optimizer op that reads them.
    for per_rank in results("tp_sp_comm"):
        update = {k: v for k, v in per_rank["update_counts"].items() if "c10d_functional" in k}
        assert update == {"c10d_functional.all_reduce": 8}, per_rank


def test_sequence_parallel_keeps_each_gathered_block_input_as_its_shard(results):
    """tp 2, 8 sequences x 32 tokens x dim 64, fp32: each block gathers its two norms' outputs (attention's
    input, the MLP's) to [8, 32, 64] (65536 bytes) for the column-parallel projections. Kept for backward
    as their [8, 16, 64] shards (32768 bytes) instead, a block saves 2 x (65536 - 32768) = 65536 bytes
    less; backward gathers each once again (shared by wq/wk/wv, by w1/w3): 2 x 4 blocks = 8 all-gathers
    more, forward's collectives unchanged; the gradients bit for bit those of the gathered tensor kept."""
    full, shard = 8 * 32 * 64 * 4, 8 * 16 * 64 * 4
    gathers = "c10d_functional.all_gather_into_tensor"
    for r in results("tp_sp_saved"):
        kept, regathered = r["kept"], r["regathered"]
        assert {block: kept["saved"][block] - regathered["saved"][block] for block in kept["saved"]} == {
            "": 0, **{f"layers.{i}": 2 * (full - shard) for i in range(4)}}
        assert regathered["forward_comm"] == kept["forward_comm"]
        assert regathered["backward_comm"] == {**kept["backward_comm"], gathers: kept["backward_comm"][gathers] + 8}
        assert regathered["loss"] == kept["loss"] and r["grads_bitwise_equal"]
        assert r["grad_max_rel_to_one_device"] < 1e-5
        # Backward split as zero-bubble schedules split it (input gradients, then the weights' from the retained
        # graph): the gathers of the first pass serve the second; the same gradients (all but the embedding's).
        assert r["split"]["backward_comm"] == regathered["backward_comm"]
        assert r["split_grad_max_abs_diff"] == 0.0 and len(r["split_grads"]) == 4 * 9 + 2


def test_sequence_parallel_shards_the_sequence(results):
    per_rank = results("tp_sp")
    report = per_rank[0]["report"]
    assert {k for k, v in report.items() if v == "sequence_parallel"} == {
        f"layers.{i}.{n}" for i in range(4) for n in ("attn_norm", "mlp_norm")}
    # The norms see half of the 32 positions on each of the 2 tp ranks.
    assert all(r["norm_input_local_shape"] == [8, 16, 64] for r in per_rank)


def test_activation_checkpointing_wraps_blocks(results):
    full = results("fsdp_ac_full")[0]
    assert full["wrapped"] == ["layers.0", "layers.1", "layers.2", "layers.3"] and full["cores"] == []
    assert results("tp_sp_ac_full_every2")[0]["wrapped"] == ["layers.1", "layers.3"]
    # A whole block recomputed runs its attention again: 4 forward + 4 recomputed; every other block: 4 + 2.
    assert full["attention_calls"] == 8 and results("tp_sp_ac_full_every2")[0]["attention_calls"] == 6
    assert not any(r["hooks_left"] for check in ("fsdp_ac_full", "tp_sp_ac_full_every2") for r in results(check))


def test_selective_recomputes_only_the_attention_core(results):
    """Megatron's selective recomputation: no block wrapped, every block's attention module marked, and the
    attention kernel called twice per block and step (forward, then again in backward), on every rank."""
    for r in results("tp_sp_ac_selective"):
        assert r["wrapped"] == []
        assert r["cores"] == [f"layers.{i}.attn" for i in range(4)]
        assert r["attention_calls"] == 8 and not r["hooks_left"]


def test_loss_parallel_keeps_the_logits_vocabulary_sharded(results):
    """With loss parallel (the default) the head's output is a Shard(2) DTensor of vocab / tp columns on
    each rank (gpt_debug: 256 / 2); off, every rank holds the whole vocabulary's logits."""
    vocab = llama_cfg().vocab_size
    for check in ("tp_sp_loss_parallel_chunked", "tp_loss_parallel_masked"):
        for r in results(check):
            assert r["loss_parallel"] is True
            assert r["logits"]["placements"] == ["S(2)"] and r["logits"]["local"][-1] == vocab // 2, r["logits"]
    report = results("tp")[0]["report"]
    assert report["output"] == "dtensor"
    assert "output" not in results("tp_loss_parallel_off")[0]["report"]
    # The pipeline's last stage (pp rank 1) computes the masked loss on its shards.
    per_rank = results("pp_tp_loss_parallel_masked")
    assert [r["logits"].get("placements") for r in per_rank] == [None, None, ["S(2)"], ["S(2)"]]


def test_mlp_raw_parameters_use_dtensor(results):
    """w0 Shard(1), w1 Shard(0): DTensor propagation; a Partial output layout stays Partial."""
    for r in results("mlp_tp"):
        assert r["report"] == {"": "dtensor"}
        assert r["local_shapes"] == {"w0": [16, 16], "w1": [16, 8]}
        assert r["partial_output"] is True
        assert r["partial_sum_max_abs_err"] < 1e-6


def test_mlp_pipeline_keeps_parameter_names(results):
    assert [r["fqns"] for r in results("mlp_pp")] == [["w0"], ["w1"]]


def test_explicit_rank_ids_leave_the_mesh_ordered(results):
    """hsdp on mesh [[1,3,5,7],[0,2,4,6]] (ids decreasing along dp_replicate): the ids only name
    devices, so the engine's mesh is torch ranks 0..7 row-major and rank r sits at position
    divmod(r, 4); its losses are one device's (test_loss_parity[hsdp_rank_ids])."""
    for r, per_rank in enumerate(results("hsdp_rank_ids")):
        assert per_rank["mesh_ranks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert per_rank["coordinate"] == list(divmod(r, 4))


def test_hf_model_in_fsdp_x_tp_gives_transformers_logits(results):
    for per_rank in results("hf_2d_logits"):
        for kind in ("llama", "qwen2", "qwen3"):
            assert per_rank[kind]["max_abs_diff"] <= 1e-5, (kind, per_rank[kind]["max_abs_diff"])
        # train.init_from on pp x tp: every parameter the rank holds (its stage's) has the file's values.
        assert per_rank["init_from_pp_tp_max_abs_diff"] == 0.0 and per_rank["init_from_pp_tp_params"] > 0
        for kind in ("llama", "qwen2"):
            styles = per_rank[kind]["report"]
            assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
            assert styles["model.layers.3.mlp.down_proj"] == "rowwise"


# ---------------------------------------------------------------------- pipeline timeline

TIMELINE_CHECKS = ["pp_GPipe", "pp_1F1B", "pp_Interleaved1F1B", "pp_InterleavedZeroBubble", "pp_ZBV",
                   "pp_1F1B_grad_accum", "3d"]
COMPUTE, COMM = ("F", "B", "I", "W"), ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@pytest.mark.parametrize("check", TIMELINE_CHECKS)
def test_timeline_holds_every_ranks_actions_in_the_schedules_order(check, results):
    """The recorded last step (``dist_checks.train``): on every rank the compute actions are its
    row of the schedule's ``pipeline_order``, in order (once per accumulation batch), one after
    the other; each activation and gradient that crosses ranks is sent and received once per
    micro-batch; the optimizer comes last. Across processes (one host's clock) a stage's forward
    starts after the previous stage's forward of that micro-batch ended on the rank it received
    from, and a backward after the next stage's backward."""
    per_rank = results(check)
    repeats = 2 if "grad_accum" in check else 1
    num_stages = 1 + max(e["stage"] for r in per_rank for e in r["timeline"] if e["kind"] in COMPUTE)
    ends: dict[tuple[int, str, int], float] = {}  # (rank, action, its n-th run) -> end
    ordered: list[list[dict]] = []  # per rank, events by start, each with its n-th run of the action
    for rank, r in enumerate(per_rank):
        events = sorted(r["timeline"], key=lambda e: e["start_us"])
        assert {e["step"] for e in events} == {STEPS} and all(e["rank"] == rank for e in events)
        assert all(e["start_us"] <= e["end_us"] for e in events)
        compute = [e for e in events if e["kind"] in COMPUTE]
        assert [e["name"] for e in compute] == r["pipeline_order"][str(r["pp_rank"])] * repeats
        serial = [e for e in events if e["kind"] in COMPUTE + ("LOSS", "OPT")]
        assert all(a["end_us"] <= b["start_us"] for a, b in zip(serial, serial[1:]))
        assert serial[-1]["name"] == "optimizer"
        stages = {e["stage"] for e in compute}
        microbatches = len({e["microbatch"] for e in compute})
        expected = []
        for s in stages:
            if s > 0 and s - 1 not in stages:  # the previous stage is on another rank
                expected += [f"{s}RECV_F{mb}" for mb in range(microbatches)] + [f"{s}SEND_B{mb}" for mb in range(microbatches)]
            if s < num_stages - 1 and s + 1 not in stages:
                expected += [f"{s}SEND_F{mb}" for mb in range(microbatches)] + [f"{s}RECV_B{mb}" for mb in range(microbatches)]
        assert sorted(e["name"] for e in events if e["kind"] in COMM) == sorted(expected * repeats)
        ordered.append([{**e, "occurrence": n} for e, n in zip(events, _occurrences(events))])
        ends.update({(rank, e["name"], e["occurrence"]): e["end_us"] for e in ordered[-1]})
    for rank, events in enumerate(ordered):
        peer_of = {(e["kind"], e["stage"], e["microbatch"], e["occurrence"]): e["peer"] for e in events if e["kind"] in COMM}
        for e in events:
            s, mb, n = e["stage"], e["microbatch"], e["occurrence"]
            if e["kind"] == "F" and ("RECV_F", s, mb, n) in peer_of:
                assert e["start_us"] >= ends[(peer_of[("RECV_F", s, mb, n)], f"{s - 1}F{mb}", n)], (rank, e)
            if e["kind"] in ("B", "I") and ("RECV_B", s, mb, n) in peer_of:
                peer = peer_of[("RECV_B", s, mb, n)]
                before = ends.get((peer, f"{s + 1}B{mb}", n), ends.get((peer, f"{s + 1}I{mb}", n)))
                assert e["start_us"] >= before, (rank, e)


def _occurrences(events: list[dict]) -> list[int]:
    """For each event, how many times its action has run so far (1 for the first)."""
    seen: dict[str, int] = {}
    out = []
    for e in events:
        seen[e["name"]] = seen.get(e["name"], 0) + 1
        out.append(seen[e["name"]])
    return out


def test_timeline_without_a_pipeline_has_forward_backward_and_optimizer(results):
    for check in ("dp", "tp"):
        for rank, r in enumerate(results(check)):
            assert r["pipeline_order"] is None
            assert [(e["name"], e["kind"]) for e in sorted(r["timeline"], key=lambda e: e["start_us"])] == [
                ("forward_backward", "FB"), ("optimizer", "OPT")], (check, rank)
