"""The conformance matrix: architectures with the shapes real checkpoints have x every layout preset
(and a mixture of experts x the expert layouts). Each cell either equals one device (the first 3
losses, fp32, rel 1e-5) or is a refusal whose printed fix, applied exactly as printed, then equals one
device, on the ranks the fix names (SmolLM2's 9 heads on a grid: 9 or 18); the few refused with no fix
that trains are :data:`NOT_BUILT`, and say so. The table in docs/conformance.md is this test's result:
the test fails when the docs say otherwise.

    pytest tests/dist/test_conformance.py -q -m slow -n 0 -s                       # launches: 2, 4, 8, 9, 18 ranks
    MESHFLOW_WRITE_CONFORMANCE=1 pytest tests/dist/test_conformance.py -q -m slow      # rewrite the table
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from conformance_checks import (ARCH_DIRS_ENV, ARCHS, MOE_ARCHS, MOE_PRESETS, PLAN_ENV, PRESETS, all_cells,
                                overrides_of, resolve_cell, train_losses)
from dist_harness import launch

pytestmark = pytest.mark.slow

EXTRA: dict[str, list[dict]] = {}  # the launches' other checks, per rank
DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
# Cells refused with no fix that trains, said so in the table (the test fails when one changes): none today
# (Qwen3's per-head q/k norms on the 2-D / 2.5-D grids, the last, are built).
NOT_BUILT: dict[str, str] = {}
DESCRIBE = {
    "smollm2": "SmolLM2-like: tied embeddings, 9 heads / 3 kv heads, rope_theta 1e5",
    "qwen25": "Qwen2.5-like: tied embeddings, q/k/v biases, 6 heads / 2 kv heads",
    "llama32": "Llama-3.2-like: tied embeddings, rope_scaling llama3, 4 heads / 2 kv heads",
    "mistral": "Mistral-like: untied, grouped-query attention 8 heads / 2 kv heads",
    "qwen3": "Qwen3-like: per-head q/k norms, head_dim 24 (not dim / heads), untied",
    "qwen3moe": "Qwen3-MoE-like: 4 experts of width 48, 2 per token, balance loss, per-head q/k norms, 6 / 2 heads",
}


def write_arch(arch: str, path: Path) -> None:
    import transformers

    from tests.hf_assets import write_llama32_like, write_tied_llama, write_tiny_llama, write_tiny_moe

    torch.manual_seed(0)
    small = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=256)
    if arch == "qwen3moe":
        write_tiny_moe(path)
    elif arch == "smollm2":
        write_tied_llama(path)
    elif arch == "llama32":
        write_llama32_like(path)
    elif arch == "qwen3":
        write_tiny_llama(path, model_type="qwen3")
    elif arch == "qwen25":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **small, hidden_size=48, intermediate_size=128, num_attention_heads=6, num_key_value_heads=2,
            tie_word_embeddings=True))
        with torch.no_grad():  # biases made non-zero, so a lost or misplaced bias shows
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)
        model.save_pretrained(path)
    else:
        transformers.MistralForCausalLM(transformers.MistralConfig(
            **small, hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2,
            sliding_window=None, tie_word_embeddings=False)).save_pretrained(path)


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    dirs = {}
    for arch in ARCHS + MOE_ARCHS:
        dirs[arch] = str(tmp_path_factory.mktemp(arch))
        write_arch(arch, Path(dirs[arch]))
    os.environ[ARCH_DIRS_ENV] = json.dumps(dirs)
    yield dirs
    os.environ.pop(ARCH_DIRS_ENV, None)


def one_device(arch: str, global_batch_size: int) -> list[float]:
    from trainer.config.compose import compose_dict
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict([*overrides_of(arch, None), f"train.global_batch_size={global_batch_size}"]))
    return train_losses(build_parallel_model(cfg, torch.device("cpu")), cfg)


@pytest.fixture(scope="module")
def matrix(arch_dirs, tmp_path_factory) -> dict[str, dict]:
    """``{"arch/layout": cell}`` over every cell; ``"arch/single@<batch>"``: one device's losses at each global
    batch size a cell trains with. Cells are resolved here first (their fixes applied) and launched one suite
    per world size their configs need, so a fix that changes the mesh runs too."""
    cells: dict[str, dict] = {}
    plan: dict[str, list[str]] = {}
    references = {(arch, 8) for arch in ARCHS + MOE_ARCHS}
    for cell in all_cells():
        cfg, result = resolve_cell(*cell.split("/"))
        if cfg is None:
            cells[cell] = result
        else:
            plan.setdefault(str(cfg.world_size), []).append(cell)
            references.add((cell.split("/")[0], cfg.train.global_batch_size))
    cells.update({f"{arch}/single@{batch}": {"status": "equal", "global_batch_size": batch,
                                             "losses": one_device(arch, batch)} for arch, batch in sorted(references)})
    os.environ[PLAN_ENV] = json.dumps(plan)
    try:
        for size in sorted(plan, key=int):
            started = time.monotonic()
            per_rank = launch(f"world{size}", world_size=int(size), out_dir=tmp_path_factory.mktemp(f"world{size}"),
                              checks="conformance_checks", timeout_s=600)
            errors = [r[check]["error"] for r in per_rank for check in r if not r[check]["ok"]]
            assert not errors, errors[0]
            cells.update({k: {**v, "world_size": int(size)} for k, v in per_rank[0]["cells"].items() if k != "ok"})
            EXTRA.update({check: [r[check] for r in per_rank] for check in per_rank[0] if check != "cells"})
            print(f"world{size}: {len(plan[size])} cells, {time.monotonic() - started:.0f} s")  # pytest -s shows it
    finally:
        os.environ.pop(PLAN_ENV, None)
    return cells


def _equal(cells: dict, key: str) -> bool:
    """The cell's losses are one device's on the same batches (its fixed config's global batch size)."""
    cell, arch = cells[key], key.split("/")[0]
    losses, reference = cell.get("losses"), cells[f"{arch}/single@{cell.get('global_batch_size', 8)}"]["losses"]
    return losses is not None and max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)) <= 1e-5


def _cell_text(cells: dict, key: str) -> str:
    if key.endswith("/single"):
        return "equal"
    if cells[key]["status"] == "equal":
        return "equal" if _equal(cells, key) else "**differs**"
    if key in NOT_BUILT and "losses" not in cells[key]:
        return f"refused: {NOT_BUILT[key]}"
    return f"refused; fixed: {'equal' if _equal(cells, key) else '**fix fails**'}"


def _rows(cells: dict, archs: list[str], layouts: list[str]) -> list[str]:
    head = ["| architecture | " + " | ".join(f"`{lay}`" for lay in layouts) + " |", "|---|" + "---|" * len(layouts)]
    return head + [f"| {arch} | " + " | ".join(_cell_text(cells, f"{arch}/{lay}") for lay in layouts) + " |"
                   for arch in archs]


def _refusal(cells: dict, key: str) -> str:
    cell = cells[key]
    reasons = "; ".join(dict.fromkeys(reason for _, reason, _ in cell["issues"]))  # one per glob, often alike
    fixes = " ".join(f"'{fix}'" if " " in fix else fix for fix in dict.fromkeys(cell.get("fixes", [])))
    (arch, layout), count = key.split("/"), len(cell["issues"])
    head = f"- {arch} on `{layout}` ({count} issue{'s' if count > 1 else ''}): {reasons}."
    if not fixes:  # prose only: quoted as printed
        return f"{head} Printed, no override: {'; '.join(dict.fromkeys(f or '(none)' for _, _, f in cell['issues']))}"
    return f"{head} Fix ({cell.get('world_size', '?')} ranks): `{fixes}`"


def table(cells: dict[str, dict]) -> str:
    lines = ["# Conformance: architectures x layouts", "",
             "Generated by `tests/dist/test_conformance.py` (`MESHFLOW_WRITE_CONFORMANCE=1 pytest "
             "tests/dist/test_conformance.py -m slow`); the test fails when this page and the engine disagree. Each "
             "architecture is a tiny checkpoint written with transformers (random weights) in the shape named; each "
             "layout is a preset of `conf/parallel` "
             "on its own mesh. **equal**: the first 3 losses equal one device's (fp32, rel 1e-5). **refused; fixed**: "
             "the validator refuses the config, and its printed fix, applied exactly as printed, gives one device's "
             "losses (the refusals and fixes are listed below); a fix that changes the mesh runs on the ranks it "
             "names, and one that changes `train.global_batch_size` is compared with one device on that batch. "
             "**refused: not built**: the refusal prints no fix that trains this model on that layout.", "",
             *_rows(cells, ARCHS, ["single", *PRESETS]), "",
             "Mixture-of-experts layouts (each expert whole on one rank of `ep`; `pp_stages_ep`'s second stage is "
             "expert parallel):", "", *_rows(cells, MOE_ARCHS, ["single", *MOE_PRESETS]), "",
             "On the dense architectures `pp_stages_ep`'s second stage holds no experts and is refused. Its printed "
             "fix, `parallel.pipeline.stages.1.expert_parallel=null`, leaves that stage's axis (still named `ep`) "
             "without a role: its 4 ranks hold the stage whole, each takes its lane's quarter of every "
             "micro-batch's rows and their gradients are summed, a data axis in all but name. That is the layout "
             "the dense cells train; the experts split over `ep` only in the mixture-of-experts table."]
    lines += ["", "Architectures:", ""] + [f"- **{arch}**: {DESCRIBE[arch]}" for arch in ARCHS + MOE_ARCHS]
    lines += ["", "## Refusals and the fixes applied", ""]
    lines += [_refusal(cells, key) for key in all_cells() if cells[key]["status"] == "refused"]
    return "\n".join(lines) + "\n"


def test_every_cell_equals_one_device_or_its_printed_fix_does(matrix):
    bad = {key: matrix[key] for key in all_cells() if key not in NOT_BUILT and not _equal(matrix, key)}
    assert not bad, json.dumps(bad, indent=1)[:6000]
    built = [key for key in NOT_BUILT if "losses" in matrix[key] or matrix[key]["status"] != "refused"]
    assert not built, f"{built} now train: take them off NOT_BUILT"


def test_the_docs_table_is_the_matrix(matrix):
    text = table(matrix)
    if os.environ.get("MESHFLOW_WRITE_CONFORMANCE") == "1":
        DOC.write_text(text)
    assert DOC.read_text() == text, ("docs/conformance.md is out of date: MESHFLOW_WRITE_CONFORMANCE=1 pytest "
                                     "tests/dist/test_conformance.py -m slow")


def test_per_head_norm_gradients_are_summed_over_tp(matrix):
    """The matrix's losses barely move with a q/k norm weight's gradient (3 AdamW steps), so the
    gradients themselves are compared: each tp rank's share alone would be about half of one device's."""
    for r in EXTRA["head_grads"]:
        assert len(r["names"]) == 8, r["names"]  # q_norm and k_norm of the 4 layers
        assert r["max_abs_diff"] <= 1e-6 * max(1.0, r["max_abs_grad"]), r
