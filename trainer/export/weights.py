"""``python -m trainer.export CHECKPOINT [--format safetensors|hf|peft] [--out PATH]``: weights out.

Any checkpoint — saved on any mesh, sharded by FSDP, TP or cut into pipeline stages — holds
the full model's parameter names (DCP + FQN-preserving stages), so one process can gather it
into the plain model. The file loads into ``build_model(cfg)`` on one device, and a run can
start from it with ``train.init_from=FILE``.

A LoRA run's checkpoint holds its adapters (and by default not the frozen base, which is read again
from ``model.path``, ``train.init_from`` or the seed the run recorded). ``safetensors`` and ``hf``
write the adapters merged into the base weights (``W + alpha / rank * B @ A``: the model without
LoRA); ``peft`` writes the adapters alone as a PEFT adapter directory (:mod:`trainer.export.peft`).

    python -m trainer.export checkpoints/step_00000100 --out model.safetensors
    python -m trainer.export checkpoints/step_00000100 --format hf --out exported/   # transformers loads it
    python -m trainer.export checkpoints/step_00000100 --format peft --out adapter/  # peft loads it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter

from parallel.sharding.ties import alias_names, first_names, tied_groups
from trainer.checkpoint.dcp import CheckpointError, read_extra, stored_model_keys
from trainer.checkpoint.safe_read import load_dcp
from trainer.config.schema import CustomModelConfig, LoRAConfig, ModelConfig
from trainer.export.hf import export_hf
from trainer.export.peft import export_peft
from trainer.export.sources import Source, template_text, tokenizer_source
from trainer.models import build_model
from trainer.models.fingerprint import mismatches, module_fingerprints
from trainer.models.init import local_box
from trainer.models.lora import is_adapter, merged_state, trainable_names


def load_checkpoint_model(checkpoint: str | Path, *, builder: str | None = None,
                          ) -> tuple[torch.nn.Module, ModelConfig, dict]:
    """``(the plain model with the checkpoint's weights, its config, the checkpoint's extra state)``,
    gathered into one process from any mesh's checkpoint. ``builder``: the ``module:function`` of a
    custom model, given by the user (``--builder``); see :func:`trusted_model_config`."""
    extra = read_extra(checkpoint)
    model_cfg = trusted_model_config(checkpoint, extra["model_config"], builder)
    base = extra.get("base") or {}  # a LoRA checkpoint without its frozen base: where the run's came from
    model = build_model(model_cfg, seed=base.get("seed", 0))
    if base.get("init_from"):
        load_weights(model, base["init_from"])
    own = unique_state_dict(model)  # a tie is stored under its first name (trainer.checkpoint.tied_keys)
    held = stored_model_keys(checkpoint)
    lacking = sorted(k for k in own if k not in held and k in trainable_names(model))
    if lacking:
        raise CheckpointError(f"cannot read checkpoint {str(checkpoint)!r}: it lacks the trained parameters "
                              f"{lacking[:4]}")
    state = {"model": {k: v for k, v in own.items() if k in held}}
    load_dcp(state, checkpoint, no_dist=True)  # one process reading on purpose
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if k in held]  # a frozen base weight left out keeps the value built above
    if set(missing) - alias_names(model) or unexpected:  # an alias shares its first name's tensor, now loaded
        raise CheckpointError(f"cannot read checkpoint {str(checkpoint)!r}: missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}")
    if "fingerprints" in extra and (wrong := mismatches(module_fingerprints(model), extra["fingerprints"],
                                                        tied_groups(model))):
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} reads back other values than the run saved "
                              f"for {wrong[:4]}",
                              fix="the checkpoint is damaged: use another one")
    return model, model_cfg, extra


def trusted_model_config(checkpoint: str | Path, saved: dict, builder: str | None) -> ModelConfig:
    """The checkpoint's model config, with no code chosen by the checkpoint: a checkpoint is data, and
    one from anywhere may name ``os:system`` as its builder. A custom model's ``model.builder`` is
    imported only when the user names it (``builder``, which replaces the checkpoint's); a model an
    installed package registers (``model.name``) and the built-ins need nothing."""
    model_cfg = TypeAdapter[ModelConfig](ModelConfig).validate_python(saved)
    if not isinstance(model_cfg, CustomModelConfig) or model_cfg.name is not None:
        if builder is not None:
            raise ValueError(f"--builder: checkpoint {str(checkpoint)!r} holds a model.arch={model_cfg.arch} model, "
                             "not one built by a function (leave --builder out)")
        return model_cfg
    if builder is None:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} names the model builder {model_cfg.builder!r}, and "
                              "a checkpoint's own metadata never chooses code to run",
                              fix=f"if you trust that function, name it yourself: --builder {model_cfg.builder}")
    return model_cfg.model_copy(update={"builder": builder})


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, format: str = "safetensors",
                      builder: str | None = None, tokenizer: str | None = None,
                      template: str | None = None) -> dict[str, Any]:
    """Write the checkpoint's model weights to ``out`` (a file; a directory for ``format="hf"``,
    see :mod:`trainer.export.hf`, with the run's tokenizer and chat template when it had them, and for
    ``"peft"``, see :mod:`trainer.export.peft`); return {"tensors": n, "bytes": size} (and for ``hf``
    the other "files" written). LoRA adapters are merged into
    their base weights except for ``peft``, which writes them alone. ``builder``: a custom model's
    ``module:function``, which the user names (:func:`trusted_model_config`); ``tokenizer`` and
    ``template``: the user's, instead of the run's (which must lie inside the checkpoint or the
    model's directory: :mod:`trainer.export.sources`)."""
    tokenizer_files, template_file = None, None
    if format == "hf":  # what ships beside the weights, refused (if it must be) before any weight is read
        saved = read_extra(checkpoint)
        model_dir = saved["model_config"].get("path") if saved["model_config"].get("arch") == "hf" else None
        tokenizer_files = tokenizer_source(checkpoint, saved, model_dir, given=tokenizer)
        template_file = template_text(checkpoint, saved, model_dir, given=template)
    model, model_cfg, extra = load_checkpoint_model(checkpoint, builder=builder)
    return export_model(model, model_cfg, out, format=format, step=extra.get("step"), tokenizer=tokenizer_files,
                        template=template_file)


def export_model(model: torch.nn.Module, model_cfg: ModelConfig, out: str | Path, *, format: str = "safetensors",
                 step: int | None = None, tokenizer: Source | None = None, template: str | None = None
                 ) -> dict[str, Any]:
    """Write the plain ``model``'s weights (built from ``model_cfg``) to ``out`` as ``format`` says
    (see :func:`export_checkpoint`); ``step`` goes into a safetensors file's metadata; ``tokenizer``
    (where its files come from) and ``template`` (a chat template's text) beside a Hugging Face
    directory's weights."""
    from safetensors.torch import save_file

    if format == "peft":
        return export_peft(model, model_cfg, out)
    state = unique_state_dict(model)
    lora = getattr(model_cfg, "lora", None)
    if lora is not None and lora.enabled:  # the model without LoRA, whose weights hold the adapters' update
        state = merged_state(model, state)
        model_cfg = model_cfg.model_copy(update={"lora": LoRAConfig()})
    if format == "hf":
        return export_hf(state, model_cfg, out, tokenizer=tokenizer, template=template)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    saved_config = TypeAdapter[ModelConfig](ModelConfig).dump_json(model_cfg).decode()
    save_file(tensors, str(out), metadata={"model_config": saved_config, "step": str(step)})
    return {"tensors": len(tensors), "bytes": Path(out).stat().st_size}


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with each tensor once: a tied parameter (input and output embeddings)
    under its first name only, as Hugging Face writes it (``tie_word_embeddings``)."""
    aliases = alias_names(model)
    return {name: value for name, value in model.state_dict().items() if name not in aliases}


def check_weights_fit(model: torch.nn.Module, path: str | Path) -> None:
    """Raise unless the safetensors file ``path`` holds exactly ``model``'s tensors, shape for
    shape; reads only the file's header, so ``model`` may be on the meta device."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"train.init_from: {str(path)!r} does not exist (give a file written by python -m "
                                "trainer.export)")
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # LoRA's adapters start from the seed: a file holds the base model's weights.
    own = {k: tuple(v.shape) for k, v in unique_state_dict(model).items() if not is_adapter(k)}
    missing, unexpected = sorted(own.keys() - shapes.keys()), sorted(shapes.keys() - own.keys())
    wrong = sorted(k for k in own.keys() & shapes.keys() if own[k] != shapes[k])
    if missing or unexpected or wrong:
        raise ValueError(f"train.init_from: {str(path)!r} does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, other shapes {wrong[:5]} "
                         "(export from a checkpoint of the same model config)")


def load_weights(parts: torch.nn.Module | list[torch.nn.Module], path: str | Path, *,
                 tied: list[list[str]] | None = None) -> None:
    """Load a safetensors file from :func:`export_checkpoint` into the plain model, or into this
    rank's sharded parts (pipeline stages, DTensor shards): each tensor reads only the block it
    holds (safetensors slices the file), so a sharded run never loads a whole parameter it does
    not hold. Checks the file against the model first when given the whole model. ``tied``: the
    model's tied names, first name first: a stage holding a tie's other name reads the first's
    (the file holds a tie once)."""
    from safetensors import safe_open

    if isinstance(parts, torch.nn.Module):
        check_weights_fit(parts, path)
        parts = [parts]
    first = first_names(tied or [])
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        in_file = set(f.keys())
        for part in parts:
            for name, tensor in unique_state_dict(part).items():  # a tied alias shares the first name's tensor
                if is_adapter(name):  # LoRA's adapters start from the seed; the file holds the base model's weights
                    continue
                key = name if name in in_file else first.get(name, name)
                offset, local = local_box(tensor)
                block = f.get_slice(key)[tuple(slice(o, o + k) for o,
                                               k in zip(offset, local))] if local else f.get_tensor(key)
                target = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                target.copy_(block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step_<n> checkpoint directory")
    parser.add_argument("--format", choices=["safetensors", "hf", "peft"], default="safetensors",
                        help="safetensors: one file for train.init_from; hf: a Hugging Face model directory (LoRA "
                        "adapters merged into the weights); peft: a LoRA run's adapters as a PEFT adapter directory")
    parser.add_argument("--out", default=None, help="output file, or directory with --format hf / peft "
                                                    "(default model.safetensors / hf_model / adapter)")
    parser.add_argument("--builder", default=None, metavar="MODULE:FUNCTION",
                        help="a custom model's builder function; a checkpoint that names its own is refused "
                        "unless you name it here (a checkpoint never chooses code to import)")
    parser.add_argument("--tokenizer", default=None, help="with --format hf: a tokenizer.json or directory to ship "
                        "instead of the run's (a run's own is copied only from inside the checkpoint or the model's "
                        "directory)")
    parser.add_argument("--template", default=None, help="with --format hf: the chat template to ship, a built-in "
                        "name (chatml) or a .jinja file, instead of the run's data.template")
    args = parser.parse_args(argv)
    args.out = args.out or {"hf": "hf_model", "peft": "adapter"}.get(args.format, "model.safetensors")
    try:
        info = export_checkpoint(args.checkpoint, args.out, format=args.format, builder=args.builder,
                                 tokenizer=args.tokenizer, template=args.template)
    except (CheckpointError, KeyError, ValueError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 2
    shipped = f", with {', '.join(info['files'])}" if info.get("files") else ""
    print(f"wrote {args.out}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB{shipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
