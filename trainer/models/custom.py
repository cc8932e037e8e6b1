"""Your own ``nn.Module``: a builder function named on the CLI, or a model an installed package registers.

    python -m trainer model=custom model.builder=my_models.net:build 'model.kwargs={width: 256}' +parallel=fsdp mesh=[4]
    python -m trainer model=custom model.name=tiny_mlp          # registered under `meshflow.models`

A builder is any importable ``module:function`` returning an ``nn.Module`` whose forward maps the
data's inputs to outputs the loss reads: token ids ``[B, T]`` to logits ``[B, T, vocab]``
(``model.loss=lm``), or features to predictions (``model.loss=mse``, ``data=regression``). The
module is built with the global RNG seeded from ``train.seed``, so every rank builds the same
values before the engine splits and shards them (parity with one device). Over REST an import
path is refused (no code from the network): the operator installs a package that lists its
builders under the ``meshflow.models`` entry-point group, and users name them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable

import torch
from torch import nn

ENTRY_POINT_GROUP = "meshflow.models"


class CustomModelError(ValueError):
    """The builder cannot be found or called: ``reason`` and ``fix`` for the validator."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason} ({fix})")
        self.reason, self.fix = reason, fix


def registered_models() -> dict[str, str]:
    """``{name: "module:function"}`` of every model installed packages register."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve_builder(builder: str | None, name: str | None) -> Callable[..., nn.Module]:
    """The builder function of ``model.builder`` (``module:function``) or ``model.name``."""
    if (builder is None) == (name is None):
        raise CustomModelError("model=custom needs exactly one of model.builder and model.name",
                               "set model.builder=module:function, or model.name=<a registered model>")
    if name is not None:
        known = registered_models()
        if name not in known:
            raise CustomModelError(f"no model {name!r} is registered under the {ENTRY_POINT_GROUP!r} entry points",
                                   f"use one of {sorted(known)}" if known else "install a package that registers it")
        builder = known[name]
    assert builder is not None, "exactly one of builder and name is given"
    module_name, _, function_name = builder.partition(":")
    if not module_name or not function_name:
        raise CustomModelError(f"{builder!r} is not module:function", "write e.g. model.builder=my_models.net:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CustomModelError(f"cannot import {module_name!r}: {err}",
                               "put the module on PYTHONPATH (or install its package)") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise CustomModelError(f"module {module_name!r} has no function {function_name!r}",
                               "name a function that returns an nn.Module")
    return function


def build_custom_model(cfg, *, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """Call the builder with ``cfg.kwargs`` on ``device`` (``meta``: shapes only), the global RNG
    seeded from ``seed`` so that every process builds the same initial values."""
    function = resolve_builder(cfg.builder, cfg.name)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        try:
            model = function(**(cfg.kwargs or {}))
        except TypeError as err:
            raise CustomModelError(f"calling {function.__module__}.{function.__name__}(**model.kwargs) failed: {err}",
                                   "give the keyword arguments the builder takes in model.kwargs") from None
    if not isinstance(model, nn.Module):
        raise CustomModelError(f"the builder returned {type(model).__name__}, not an nn.Module",
                               "return the model (an nn.Module) from the builder")
    return model
