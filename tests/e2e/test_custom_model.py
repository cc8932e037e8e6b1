"""Your own nn.Module from a file outside the package, trained with explicit placements: the
pair's parent adds a residual and is called with a keyword argument (both used to crash in
the workers), and the losses equal one device's. Over REST an import path is refused.

    pytest tests/e2e/test_custom_model.py -q -s
"""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow

NET = textwrap.dedent('''
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width, hidden):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))  # residual add in the pair's parent


    class Net(nn.Module):
        def __init__(self, vocab, width, hidden, depth):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(x=h)  # called with a keyword argument
            return self.head(h)


    def build(vocab=256, width=32, hidden=64, depth=2):
        return Net(vocab, width, hidden, depth)
''')
# The tp preset without the megatron plan (a custom module has none), and the Megatron pair as globs.
PLACEMENTS = ["+parallel=tp", "mesh=[2]", "parallel.tensor_parallel=null",
              '+parallel.placements={blocks.*.up.weight: {tp: "Shard(0)"}, blocks.*.up.bias: {tp: "Shard(0)"}, '
              'blocks.*.down.weight: {tp: "Shard(1)"}}']
COMMON = ["model=custom", "model.builder=my_models.net:build", "model.kwargs={width: 32, hidden: 64}", "data=synthetic",
          "train.steps=5", "train.global_batch_size=8", "train.seq_len=32", "train.log_every=1"]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    root = tmp_path_factory.mktemp("outside")
    (root / "my_models").mkdir()
    (root / "my_models" / "__init__.py").write_text("")
    (root / "my_models" / "net.py").write_text(NET)
    return root


def _losses(cwd, package, extra: list[str]) -> list[float]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    env = {"PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    proc = run_cli([*COMMON, *extra, f"tracking.tracking_uri={uri}"], cwd=cwd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)]


def test_custom_module_trains_with_explicit_placements_and_parity(package, tmp_path):
    runs = {"single": [], "tp": PLACEMENTS, "fsdp": ["+parallel=fsdp", "mesh=[2]"]}
    losses = {}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        losses[name] = _losses(tmp_path / name, package, extra)
    print(losses)
    single = losses.pop("single")
    assert len(single) == 5 and single[0] > single[-1]
    for run in losses.values():
        assert max(abs(a - b) / abs(b) for a, b in zip(run, single)) <= 1e-5


def test_custom_model_errors_name_the_field(package, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    proc = run_cli(["model=custom", "model.builder=my_models.nowhere:build", "validate_only=true"], cwd=tmp_path,
                   env=env)
    assert proc.returncode == 2 and "model.builder: cannot import 'my_models.nowhere'" in proc.stderr
    proc = run_cli(["model=custom", "model.builder=my_models.net:build", "model.kwargs={colour: red}",
                    "validate_only=true"], cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "model.kwargs: calling my_models.net.build(**model.kwargs) failed" in proc.stderr
    proc = run_cli([*COMMON, "+parallel=pp", "mesh=[2]", "validate_only=true"], cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "parallel.pipeline:" in proc.stderr


def test_registered_model_by_name_from_cli_and_rest(package, tmp_path, monkeypatch):
    """An installed package lists `tiny_net = my_models.net:build` under the `meshflow.models` entry
    points (here: a .dist-info beside the module on the path, as pip leaves it); CLI and REST name it."""
    from service.submit import resolve_config

    dist = package / "my_models-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-models\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[meshflow.models]\ntiny_net = my_models.net:build\n")
    env = {"PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    proc = run_cli(["model=custom", "model.name=tiny_net", "validate_only=true"], cwd=tmp_path, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("config OK: custom model"), proc.stderr
    monkeypatch.syspath_prepend(str(package))
    cfg, _ = resolve_config(overrides=["model=custom", "model.name=tiny_net", "model.kwargs={width: 16}"],
                            document=None,
                            workspace=tmp_path, workdir=tmp_path / "job", tracking_uri="sqlite:///x.db", run_id=None)
    assert (cfg.model.name, cfg.model.kwargs) == ("tiny_net", {"width": 16})


def test_rest_never_imports_a_builder_it_was_sent(tmp_path, monkeypatch):
    """The 422 comes before validation, which would import the module and call the function."""
    import trainer.models.custom as custom
    from parallel.errors import ConfigError
    from service.submit import resolve_config

    monkeypatch.setattr(custom, "resolve_builder", lambda *args: pytest.fail("the server imported a sent builder"))
    monkeypatch.setattr(custom, "build_custom_model", lambda *args, **kw: pytest.fail("the server built a sent model"))
    with pytest.raises(ConfigError) as err:
        resolve_config(overrides=["model=custom", "model.builder=os:system"], document=None, workspace=tmp_path,
                       workdir=tmp_path / "job", tracking_uri="sqlite:///x.db", run_id=None)
    assert [issue.path for issue in err.value.issues] == ["model.builder"]
