"""Bad submissions get 422 with each problem's path, reason and fix, and nothing is stored or run."""

from __future__ import annotations

import pytest

PLACEMENT = 'parallel.tensor_parallel.plan[megatron]["layers.*.mlp.w[13].weight"].tp'

# (overrides, the path the 422 must name, a word its reason must contain)
BAD_OVERRIDES = [
    (["+parallel=tp", "mesh=[8]"], PLACEMENT, "not divisible"),
    (["+model._target_=os.system"], "overrides[0]", "_target_"),
    (["hydra.run.dir=/tmp/elsewhere"], "hydra.run.dir", "hydra"),
    (["hydra/launcher=basic"], "hydra.launcher", "hydra"),
    (["train.checkpoint.dir=../../escape"], "train.checkpoint.dir", "escapes"),
    (["train.checkpoint.dir=/tmp/abs"], "train.checkpoint.dir", "absolute"),
    (["train.checkpoint.resume=../other-job/checkpoints/step_5"], "train.checkpoint.resume", "escapes"),
    (["launch.log_dir=/tmp/logs"], "launch.log_dir", "absolute"),
    (["launch.log_dir=../../logs"], "launch.log_dir", "escapes"),
    (["data.root=/etc"], "data.root", "outside"),
    (["data.root=../../.."], "data.root", "escapes"),
    (["data.root=../00000000-0000-0000-0000-000000000000"], "data.root", "escapes"),  # another job's files
    (["data.root=../..", "data.glob=meshflow.db*"], "data.root", "escapes"),          # the job store
    (["data.root=datasets/../../meshflow.db"], "data.root", "escapes"),
    (["data.glob=../../**/*.py"], "data.glob", "outside"),
    (["train.init_from=/etc/shadow"], "train.init_from", "absolute"),
    (["train.init_from=../00000000-0000-0000-0000-000000000000/model.safetensors"], "train.init_from", "escapes"),
    (["train.init_from=models/missing.safetensors"], "train.init_from", "not a file"),  # confined first, then checked
    (["model=hf", "model.path=/etc"], "model.path", "outside"),
    (["model=hf", "model.path=../../.."], "model.path", "escapes"),
    (["model=custom", "model.builder=os:system"], "model.builder", "import path"),
    (["train.seed=${oc.env:HOME}"], "overrides[0]", "interpolation"),
    (["~train.seed"], "train.seed", "~key"),
    (["++train.seed=1"], "train.seed", "++key"),
    (["train.seed=1,2"], "train.seed", "sweep"),
    (["model=../../etc/passwd"], "model", "not a preset"),
    (["model/extra=gpt_small"], "model.extra", "not a config group"),
    (["launch.rdzv_endpoint=10.0.0.1:29500"], "launch.rdzv_endpoint", "loopback"),
    (["train.steps=0"], "train.steps", "greater"),
    (["train.nope=1"], "train.nope", "unknown key"),  # composed like a known key; validation names it
]


@pytest.mark.parametrize("overrides, path, word", BAD_OVERRIDES, ids=[" ".join(o) for o, _, _ in BAD_OVERRIDES])
def test_bad_overrides_are_refused_with_the_path(queue_server, overrides, path, word):
    server = queue_server
    with server.client("bob") as bob:
        before = bob.get("/v1/jobs").json()["total"]
        response = bob.post("/v1/jobs", json={"name": "bad", "overrides": overrides})
        assert response.status_code == 422, response.text
        problems = response.json()["detail"]
        assert all(set(p) == {"path", "reason", "fix"} and p["fix"] for p in problems)
        match = [p for p in problems if p["path"] == path]
        assert match, problems
        assert any(word in p["reason"] for p in match), match
        assert bob.post("/v1/plans", json={"overrides": overrides}).status_code == 422
        assert bob.get("/v1/jobs").json()["total"] == before


def test_the_api_does_not_say_whether_an_outside_file_exists(queue_server):
    """Refused before any filesystem call: an existing and a missing outside file get the same answer."""
    with queue_server.client("bob") as bob:
        reasons = [bob.post("/v1/jobs", json={"overrides": [f"train.init_from={path}"]}).json()["detail"][0]["reason"]
                   for path in ("/etc/passwd", "/etc/no-such-file")]
    assert reasons[0].replace("passwd", "X") == reasons[1].replace("no-such-file", "X")


def test_bad_documents_are_refused(queue_server):
    server = queue_server
    from trainer.config.compose import compose_dict

    good = compose_dict(["train.steps=3"])
    cases = [
        ({**good, "model": {**good["model"], "_target_": "os.system"}}, "model._target_"),
        ({**good, "hydra": {"run": {"dir": "/tmp"}}}, "hydra"),
        ({**good, "data": {**good["data"], "root": "/etc"}}, "data.root"),
        ({**good, "train": {**good["train"], "checkpoint": {**good["train"]["checkpoint"], "dir": "/"}}},
         "train.checkpoint.dir"),
        ({**good, "tracking": {**good["tracking"], "run_name": "${oc.env:HOME}"}}, "tracking.run_name"),
        ({**good, "model": {"arch": "custom", "builder": "os:system"}}, "model.builder"),
        ({**good, "model": {"arch": "hf", "path": "/etc"}}, "model.path"),
    ]
    with server.client("bob") as bob:
        before = bob.get("/v1/jobs").json()["total"]
        for document, path in cases:
            response = bob.post("/v1/jobs", json={"config": document})
            assert response.status_code == 422, (path, response.text)
            assert path in [p["path"] for p in response.json()["detail"]], response.json()
        assert bob.get("/v1/jobs").json()["total"] == before


def test_malformed_requests_use_the_same_problem_shape(queue_server):
    server = queue_server
    with server.client("bob") as bob:
        for body in ({"overrides": "train.steps=3"}, {"overrides": [], "config": {}}, {"name": ""}, {"surprise": 1},
                     {"name": "neither"}, {"overrides": None, "config": {}}):
            response = bob.post("/v1/jobs", json=body)
            assert response.status_code == 422, body
            assert all(set(p) == {"path", "reason", "fix"} for p in response.json()["detail"])
        response = bob.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 422
        huge = {"name": "big", "overrides": ["train.steps=3"], "config": None, "pad": "x" * 2_000_000}
        assert bob.post("/v1/jobs", json=huge).status_code == 413

        def chunks():  # no Content-Length: the limit applies while the body is read
            yield b'{"name": "chunked", "overrides": ["'
            for _ in range(40):
                yield b"x" * 50_000
            yield b'"]}'

        assert bob.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"}).status_code == 413


def test_a_mesh_larger_than_the_capacity_is_refused(server):
    with server.client("bob") as bob:
        response = bob.post("/v1/jobs", json={"overrides": ["+parallel=dp", "mesh=[4]", "train.global_batch_size=4"]})
        assert response.status_code == 422
        assert response.json()["detail"][0]["path"] == "mesh" and "slots" in response.json()["detail"][0]["reason"]
