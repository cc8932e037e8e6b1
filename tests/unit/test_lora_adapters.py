"""LoRA adapters (trainer.models.lora): which Linears get them, frozen base weights, PEFT's
initialisation seeded by name (the same on meta and shard by shard), the merged weights, the
config's refusals, and the plan's memory of frozen weights."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config.schema import LlamaConfig, LoRAConfig
from trainer.models import build_model
from trainer.models.init import initial_block
from trainer.models.lora import LoRALinear, merged_state

SMALL = dict(n_layers=2)


def test_default_targets_get_adapters_and_everything_else_is_frozen():
    model = build_model(LlamaConfig(**SMALL, lora=LoRAConfig(rank=4)), seed=0)
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
    assert adapted == sorted(f"layers.{i}.{p}" for i in range(2) for p in
                             ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora_{x}.weight" for m in adapted for x in "AB"}
    assert model.layers["0"].attn.wk.lora_A.weight.shape == (4, 64)
    assert model.layers["0"].attn.wk.lora_B.weight.shape == (32, 4)  # kv heads: 2 x 16


def test_peft_initialisation_leaves_the_base_models_output():
    cfg = LlamaConfig(**SMALL)
    base, lora = build_model(cfg, seed=0), build_model(cfg.model_copy(update={"lora": LoRAConfig(rank=4)}), seed=0)
    wq = lora.layers["0"].attn.wq
    bound = 1 / math.sqrt(64)  # kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
    assert 0.9 * bound < float(wq.lora_A.weight.detach().abs().max()) <= bound
    assert float(wq.lora_B.weight.detach().abs().max()) == 0.0
    assert wq.scaling == 2.0  # alpha defaults to 2 * rank
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(base(tokens), lora(tokens))
    # Only the adapters differ from the base model's parameters.
    base_state = base.state_dict()
    assert all(torch.equal(v, base_state[k]) for k, v in lora.state_dict().items() if "lora_" not in k)


def test_adapters_are_seeded_by_name_on_meta_and_shard_by_shard():
    cfg = LlamaConfig(**SMALL, lora=LoRAConfig(rank=4, targets=["layers.*.attn.w[qv]"]))
    direct = build_model(cfg, seed=3)
    meta = build_model(cfg, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    assert all(torch.equal(a, b) for a, b in zip(direct.parameters(), meta.parameters(), strict=True))
    a = direct.layers["1"].attn.wv.lora_A.weight
    # A shard's block (rows 1..3, columns 32..63) is the full value's block.
    block = initial_block(a.shape, (1, 32), (2, 32), "layers.1.attn.wv.lora_A.weight", 3, 1 / 8, kind="uniform")
    assert torch.equal(block, a.detach()[1:3, 32:64])
    other = build_model(cfg, seed=4).layers["1"].attn.wv.lora_A.weight
    assert not torch.equal(a, other)


def test_merged_weights_are_base_plus_scaled_update():
    model = build_model(LlamaConfig(**SMALL, lora=LoRAConfig(rank=2, alpha=6, targets=["layers.0.mlp.w2"])), seed=0)
    w2 = model.layers["0"].mlp.w2
    with torch.no_grad():
        w2.lora_B.weight.normal_()
    merged = merged_state(model, model.state_dict())
    assert not any("lora" in k for k in merged)
    want = w2.weight + 3.0 * w2.lora_B.weight @ w2.lora_A.weight
    assert torch.allclose(merged["layers.0.mlp.w2.weight"], want, atol=1e-6)
    plain = build_model(LlamaConfig(**SMALL), seed=0)
    plain.load_state_dict(merged)
    x = torch.randint(0, 256, (1, 8))
    assert torch.allclose(plain(x), model(x), atol=1e-5)


@pytest.mark.parametrize("override, path, reason", [
    ("model.lora.targets=[layers.*.attn.nope]", "model.lora.targets[0]", "matches no Linear"),
    ("model.lora.rank=40", "model.lora.rank", "exceeds min(in, out) = 32 of layers.0.attn.wk"),
])
def test_bad_lora_settings_are_refused_with_a_fix_that_validates(override, path, reason):
    from parallel.errors import ConfigError
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(compose_dict(["model=gpt_debug", "model.lora.rank=4", override]))
    (issue,) = err.value.issues
    assert issue.path == path and reason in issue.reason, issue
    fix = issue.fix.split("e.g. ")[-1].split(" or lower")[0].removeprefix("use ")
    cfg = validate_config(compose_dict(["model=gpt_debug", "model.lora.rank=4", override, fix]))
    assert cfg.model.lora.enabled


def test_the_plan_counts_gradients_and_adamw_of_the_adapters_only():
    from parallel.plan.resolve import resolve_plan
    from trainer.config.compose import compose_dict
    from trainer.planner.numbers import plan_numbers
    from trainer.validate.checks import validate_config

    full = validate_config(compose_dict(["model=gpt_debug", "+parallel=fsdp", "mesh=[2]"]))
    lora = validate_config(compose_dict(["model=gpt_debug", "+parallel=fsdp", "mesh=[2]", "model.lora.rank=4"]))
    rows = {}
    for name, cfg in (("full", full), ("lora", lora)):
        model = build_model(cfg.model, device="meta")
        (rows[name],) = plan_numbers(cfg, resolve_plan(cfg.parallel, cfg.mesh, model), model=model).per_pp_rank
        rows[name + "_trained"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert rows["lora"].grad_bytes == rows["lora_trained"] * 4 / 2  # fsdp [2] shards them
    assert rows["lora"].optim_bytes == 2 * rows["lora"].grad_bytes
    assert rows["lora"].param_bytes == rows["full"].param_bytes + rows["lora"].grad_bytes
    assert rows["full"].grad_bytes == rows["full"].param_bytes
