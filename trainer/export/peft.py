"""A LoRA run's adapters out as a PEFT adapter directory: ``adapter_config.json`` +
``adapter_model.safetensors`` with PEFT's key names, which ``peft.PeftModel.from_pretrained`` puts on
the ``transformers`` model of the run's ``model.path``:

    python -m trainer.export checkpoints/step_00000200 --format peft --out adapter/

    base = AutoModelForCausalLM.from_pretrained("/data/smol")
    model = PeftModel.from_pretrained(base, "adapter/")          # the trainer's logits

A model from ``model=hf`` names its modules as ``LlamaForCausalLM`` does, so the keys are the
trainer's own under PEFT's prefix (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)
and the adapters' values go out unchanged. The built-in decoder has no Hugging Face base directory
to name: its adapters go out merged (``--format hf``). Nothing here imports ``peft``.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from trainer.config.schema import HFModelConfig
from trainer.models.hf import model_dir
from trainer.models.init import canonical_fqn
from trainer.models.lora import LoRALinear, is_adapter

PEFT_PREFIX = "base_model.model."


def target_modules(model: nn.Module) -> list[str]:
    """PEFT's ``target_modules`` for the adapted Linears of ``model``: their last names (``q_proj``)
    when every Linear of those names has adapters, else the full module names (PEFT matches a
    name exactly or as a dotted suffix)."""
    adapted = [canonical_fqn(n) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    suffixes = {name.rsplit(".", 1)[-1] for name in adapted}
    others = [canonical_fqn(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)
              and not isinstance(m, LoRALinear) and not is_adapter(n) and n.rsplit(".", 1)[-1] in suffixes]
    return sorted(suffixes) if not others else sorted(adapted)


def adapter_config(model_cfg: HFModelConfig, model: nn.Module) -> dict:
    """``adapter_config.json`` of ``model``'s adapters (PEFT's LoraConfig fields)."""
    lora, base = model_cfg.lora, Path(model_dir(model_cfg)).resolve()
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": lora.rank, "lora_alpha": lora.scaling * lora.rank, "lora_dropout": lora.dropout,
        "target_modules": target_modules(model), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "revision": None,
    }


def export_peft(model: nn.Module, model_cfg, out: str | Path) -> dict[str, int]:
    """Write ``model``'s LoRA adapters (a plain model with the checkpoint's values) as a PEFT adapter
    directory ``out``; returns ``{"tensors": n, "bytes": size}``."""
    from safetensors.torch import save_file

    lora = getattr(model_cfg, "lora", None)
    if lora is None or not lora.enabled:
        raise ValueError("--format peft: the run trained no LoRA adapters (model.lora.rank is 0); export the full "
                         "model with --format hf")
    if not isinstance(model_cfg, HFModelConfig):
        raise ValueError(f"--format peft: model {model_cfg.arch} has no Hugging Face base directory for "
                         "PEFT to put the "
                         "adapters on; export the merged model with --format hf")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + canonical_fqn(name): p.detach().contiguous()
               for name, p in model.named_parameters() if is_adapter(name)}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(model_cfg, model), indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return {"tensors": len(tensors), "bytes": (out / "adapter_model.safetensors").stat().st_size}
