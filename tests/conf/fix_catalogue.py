"""The refusals :mod:`test_printed_fixes` walks beyond the cases of ``test_bad_configs`` and
``test_stage_configs``: :data:`MORE` (bad configs as overrides), :data:`HOST` (refusals of this
host, made by patching what the validator reads of it), and :data:`PROSE`, the refusals whose fix
names no override, each with the reason (keyed by a phrase of its ``ConfigIssue(...)`` source
and the file it is in)."""

from __future__ import annotations

import torch
from test_bad_configs import Bad, bad
from test_context_configs import CASES as CONTEXT_CASES
from test_grid_configs import CASES as GRID_CASES
from test_cube_configs import CASES as CUBE_CASES

def _mistral_with_a_window() -> str:
    """A Mistral config.json (no weights: validation reads the config) whose attention slides over 16 tokens."""
    import json
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="meshflow-mistral-"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "sliding_window": 16, "tie_word_embeddings": False}))
    return str(path)


def _chat_assets(template: str | None = None) -> str:
    """A tokenizer directory (no chat template, or ``template``) and a chat file, in a temporary directory."""
    import tempfile
    from pathlib import Path

    from tests.hf_assets import conversations, write_chats, write_tokenizer

    path = Path(tempfile.mkdtemp(prefix="meshflow-chat-"))
    write_tokenizer(path / "tok")
    write_chats(path / "chats.jsonl", conversations(2))
    if template is not None:
        (path / "reasoning.jinja").write_text(template)
    (path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")  # a syntax error
    return str(path)


# A template that drops earlier replies (as reasoning templates drop earlier thoughts): replies cannot be located.
_FORGETFUL = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}{{ m.role }}: {{ m.content }}\n"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
_CHAT = _chat_assets(_FORGETFUL)


def _pickled_weights() -> str:
    """A ``torch.save`` file (a pickle) where a safetensors file belongs."""
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="meshflow-pickle-")) / "model.pt"
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2)}, path)
    return str(path)

_CHAT_DATA = ["model=gpt_debug", "model.vocab_size=512", "data=chat", f"data.tokenizer={_CHAT}/tok",
              f"data.paths=[{_CHAT}/chats.jsonl]"]

_EMBEDDING = ["model=custom", "model.builder=torch.nn:Embedding",
              "model.kwargs={num_embeddings: 256, embedding_dim: 256}"]



def _used_checkpoint_dir() -> str:
    """A checkpoint directory holding another run's finished checkpoint of the default model (what the
    launcher refuses to start a fresh run in, and what train.checkpoint.resume=auto continues), in a
    temporary directory."""
    import tempfile
    from pathlib import Path

    from trainer.checkpoint.dcp import save_checkpoint
    from trainer.config.compose import compose_dict
    from trainer.models import build_model
    from trainer.validate.checks import validate_config

    path = Path(tempfile.mkdtemp(prefix="meshflow-used-")) / "checkpoints"
    model_cfg = validate_config(compose_dict([])).model
    model = build_model(model_cfg)
    save_checkpoint(path, 100, model=model, optimizer=torch.optim.AdamW(model.parameters()), keep=1,
                    extra={"step": 100, "model_config": model_cfg.model_dump(mode="json")})
    return str(path)


_TWO_NODES = ["+parallel=dp", "mesh=[2]", "launch.nnodes=2", "launch.rdzv_endpoint=10.0.0.1:29500"]

MORE: dict[str, Bad] = {
    "more/checkpoint-dir-of-another-run": bad([f"train.checkpoint.dir={_used_checkpoint_dir()}"],
                                              "train.checkpoint.dir", ["already holds another run's checkpoints"],
                                              ["train.checkpoint.resume=auto", "train.checkpoint.dir="]),
    "more/restarts-on-node-local-checkpoints": bad([*_TWO_NODES, "launch.max_restarts=1"], "train.checkpoint.dir",
                                                   ["is relative with launch.nnodes=2"],
                                                   ["train.checkpoint.dir=/mnt/shared/checkpoints"]),
    "more/resume-on-node-local-checkpoints": bad([*_TWO_NODES, "train.checkpoint.resume=auto"],
                                                 "train.checkpoint.dir", ["train.checkpoint.resume=auto needs"]),
    **CONTEXT_CASES,
    **GRID_CASES,
    **CUBE_CASES,
    "more/data-files-without-paths": bad(["data=files"], "data.paths", ["names no files"]),
    "more/auto-with-rank-ids": bad(["+parallel=auto", "mesh=[[0,1],[2,3]]"], "mesh", ["not explicit rank ids"]),
    "more/rdzv-not-host-port": bad(["launch.rdzv_endpoint=nohost"], "launch.rdzv_endpoint", ["not host:port"]),
    "more/slurm-node-rank": bad(["+parallel=fsdp", "mesh=[4]", "launch.executor=slurm", "launch.nnodes=2",
                                 "launch.node_rank=1"], "launch.node_rank", ["with launch.executor=slurm"]),
    "more/print-config-not-a-bool": bad(["train.print_config=maybe"], "train.print_config", ["valid boolean"],
                                        ["train.print_config=true"]),
    "more/progress-every-below-zero": bad(["train.progress_every_s=-1"], "train.progress_every_s",
                                          ["greater than or equal to 0", "got -1"], ["train.progress_every_s=0"]),
    "more/ui-url-without-scheme": bad(["tracking.ui_url=localhost:5000"], "tracking.ui_url", ["not an http(s) URL"],
                                      ["tracking.ui_url=http://127.0.0.1:5000"]),
    "more/ui-url-bad-port": bad(["tracking.ui_url=http://127.0.0.1:99999"], "tracking.ui_url", ["not an http(s) URL"]),
    "more/eval-without-validation-split": bad(["data=synthetic", "train.eval_every=10"], "train.eval_every",
                                              ["no validation split"]),
    "more/zbv-with-validation-split": bad(
        ["+parallel=pp", "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=2",
         "data.val_fraction=0.1"],
        "parallel.pipeline.schedule", ["ZBV cannot evaluate"]),
    "more/custom-model-loss": bad([*_EMBEDDING, "model.loss=mse"], "model.loss", ["trained with the lm loss"]),
    "more/custom-model-on-a-pipeline": bad([*_EMBEDDING, "+parallel=pp"], "parallel.pipeline", ["custom module"]),
    "more/resume-from-nothing": bad(["train.checkpoint.resume=/nonexistent/meshflow-ckpt"], "train.checkpoint.resume",
                                    []),
    "more/stages-with-rank-ids": bad(["+parallel=pp_stages", "mesh=[[0,1,2,3]]"], "mesh", ["the stages already say"]),
    "more/init-from-a-pickle": bad([f"train.init_from={_pickled_weights()}"], "train.init_from",
                                   ["is a pickle (torch.save)", "header does not read"]),
    "more/init-from-nothing": bad(["train.init_from=/nonexistent/model.safetensors"], "train.init_from",
                                  ["not a file"]),
    "more/odd-head-width": bad(["model.dim=96", "model.n_heads=32", "model.n_kv_heads=32"], "model.n_heads", ["odd"]),
    "more/memory-budget": bad(["model=gpt_small", "+parallel=pp", "launch.memory_budget_gb=0.40"],
                              "launch.memory_budget_gb", ["exceeds the budget"]),
    "more/eval-at-start-without-a-split": bad(["data=text", "train.eval_at_start=true"], "train.eval_at_start",
                                              ["no validation split"]),
    "more/sequences-past-a-sliding-window": bad(["model=hf", f"model.path={_mistral_with_a_window()}",
                                                 "train.seq_len=32"],
                                                "train.seq_len", ["sliding window of 16"]),
    "more/chat-tokenizer-without-a-template": bad(_CHAT_DATA, "data.template", ["has no chat template"]),
    "more/chat-template-unknown": bad([*_CHAT_DATA, "data.template=alpaca"], "data.template", ["neither a built-in"]),
    "more/chat-template-forgets-replies": bad([*_CHAT_DATA, f"data.template={_CHAT}/reasoning.jinja"], "data.template",
                                              ["renders an earlier turn differently"]),
    "more/chat-template-does-not-render": bad([*_CHAT_DATA, f"data.template={_CHAT}/broken.jinja"], "data.template",
                                              ["does not render a conversation", "TemplateSyntaxError"]),
    "more/chat-two-validation-splits": bad([*_CHAT_DATA, "data.template=chatml",
                                            f"data.val_paths=[{_CHAT}/chats.jsonl]",
                                            "data.val_fraction=0.1"], "data.val_fraction",
                                           ["as well as data.val_paths"]),
    "more/lora-target-matches-nothing": bad(["model.lora.rank=4", "model.lora.targets=[nothing.*]"],
                                            "model.lora.targets[0]", ["matches no Linear"]),
    "more/lora-rank-above-a-target": bad(["model.lora.rank=100"], "model.lora.rank", ["exceeds min(in, out)"]),
    "more/lora-no-targets": bad(["model.lora.rank=4", "model.lora.targets=[]"], "model.lora.targets", ["is empty"]),
    "more/packing-for-a-custom-model": bad([*_EMBEDDING, "data=files", "data.packing=true"], "data.packing",
                                           ["takes no positions"]),
    "more/packing-between-stage-layouts": bad(["+parallel=pp_stages", "data=files", "data.packing=true"],
                                              "data.packing",
                                              ["do not pass"]),
    "more/batch-and-heads-in-one-round": bad(  # independent issues come together (issue 30)
        ["+parallel=3d", "mesh=[2,2,4]", "train.global_batch_size=3"],
        'parallel.tensor_parallel.plan[megatron]["layers.*.attn.wo.weight"].tp', ["split by heads"]),
    # Mixture of experts and the ep axis (issue 31): what is built, and what is refused until it is.
    "moe/ep-without-experts": bad(["+parallel=ep"], "parallel.expert_parallel", ["has no experts"], ["model=gpt_moe"]),
    "moe/top-k-above-the-experts": bad(["model=gpt_moe", "model.moe.top_k=9"], "model.moe.top_k", ["only 8"],
                                       ["model.moe.top_k=8"]),
    "moe/experts-not-divisible-by-ep": bad(["model=gpt_moe", "+parallel=ep", "model.moe.num_experts=6"],
                                           "model.moe.num_experts", ["6 experts do not split", "size 4"],
                                           ["model.moe.num_experts=8"]),
    "moe/ep-beside-ddp": bad(["model=gpt_moe", "+parallel=fsdp_ep", "mesh=[2,2]", "parallel.data_parallel.mode=ddp"],
                             "parallel.data_parallel.mode", ["fsdp, zero2 or hsdp, not ddp"],
                             ["parallel.data_parallel.mode=fsdp"]),
    "moe/ep-beside-zero1": bad(["model=gpt_moe", "+parallel=fsdp_ep", "mesh=[2,2]",
                                "parallel.data_parallel.mode=zero1"],
                               "parallel.data_parallel.mode", ["fsdp, zero2 or hsdp, not ddp or zero1"],
                               ["parallel.data_parallel.mode=fsdp"]),
    "moe/sequence-parallel": bad(["model=gpt_moe", "+parallel=tp_sp"], "parallel.tensor_parallel.sequence_parallel",
                                 ["not built yet"], ["parallel.tensor_parallel.sequence_parallel=false"]),
    "moe/activation-checkpointing": bad(["model=gpt_moe", "+parallel=fsdp", "parallel.activation_checkpointing=full"],
                                        "parallel.activation_checkpointing", ["not tested yet"],
                                        ["parallel.activation_checkpointing=none"]),
    # `selective` is Megatron's attention-core recomputation of every block; every n-th block is `full`'s knob.
    "ac/selective-every-n": bad(["+parallel=fsdp", "mesh=[2]", "parallel.activation_checkpointing=selective",
                                 "parallel.activation_checkpointing_every=2"],
                                "parallel.activation_checkpointing_every",
                                ["attention core", "full with activation_checkpointing_every"],
                                ["parallel.activation_checkpointing=full"]),
    "ac/selective-without-attention": bad([*_EMBEDDING, "+parallel=fsdp", "mesh=[2]",
                                           "parallel.activation_checkpointing=selective"],
                                          "parallel.activation_checkpointing", ["no attention module"],
                                          ["parallel.activation_checkpointing=full"]),
    "ac/selective-with-cp": bad(["+parallel=cp", "parallel.activation_checkpointing=selective"],
                                "parallel.activation_checkpointing", ["context parallelism", "not built"],
                                ["parallel.activation_checkpointing=full"]),
    "moe/compile": bad(["model=gpt_moe", "train.compile=true"], "train.compile", ["not tested yet"],
                       ["train.compile=false"]),
    # Knobs that spend disk, CPU, time or memory have ceilings (issue 36); the fix is the ceiling itself.
    "ceiling/checkpoints-kept": bad(["train.checkpoint.keep=1000000", "train.checkpoint.every=1"],
                                    "train.checkpoint.keep", ["less than or equal to 1000"],
                                    ["train.checkpoint.keep=1000"]),
    "ceiling/metrics-interval": bad(["tracking.system_metrics_interval=0.001"], "tracking.system_metrics_interval",
                                    ["greater than or equal to 1"], ["tracking.system_metrics_interval=1"]),
    "ceiling/timeline-steps": bad(["tracking.timeline_steps=1000000"], "tracking.timeline_steps",
                                  ["less than or equal to 1000"], ["tracking.timeline_steps=1000"]),
    "ceiling/rendezvous-timeout": bad(["launch.rdzv_timeout_s=1e9"], "launch.rdzv_timeout_s",
                                      ["less than or equal to 86400"], ["launch.rdzv_timeout_s=86400"]),
    "ceiling/text-bytes": bad(["data.max_bytes=1e12"], "data.max_bytes", ["less than or equal to 1073741824"],
                              ["data.max_bytes=1073741824"]),
    # Hardware profiles (issue 34): a GPU profile states every number; its nodes hold the mesh.
    "hardware/profile-without-memory": bad(["hardware=h100_sxm", "dry_run=true", "hardware.memory_gb=null"],
                                           "hardware.memory_gb", ["states no memory_gb"]),
    "hardware/profile-without-a-link": bad(["hardware=h100_sxm", "dry_run=true", "hardware.intra_node=null"],
                                           "hardware.intra_node", ["states no intra_node"]),
    "hardware/profile-without-bf16": bad(["hardware=b200", "dry_run=true", "~hardware.peak_tflops.bf16"],
                                         "hardware.peak_tflops.bf16", ["states no peak_tflops.bf16"]),
    "hardware/more-devices-than-a-node": bad(["hardware=a100_80g", "dry_run=true", "+parallel=fsdp", "mesh=[16]"],
                                             "launch.nnodes", ["holds 8 devices"]),
    # A config group's option Hydra cannot find (issue 45): refused while composing, the fix typed in its place.
    "group/unknown-option": bad(["+parallel=fdsp"], "parallel", ["unknown option 'fdsp'"], ["+parallel=fsdp"]),
    "group/unknown-default-option": bad(["model=gpt_mo"], "model", ["unknown option 'gpt_mo'"], ["model=gpt_moe"]),
    "group/chosen-without-plus": bad(["parallel=fsdp"], "parallel", ["does not choose"], ["+parallel=fsdp"]),
    "group/chosen-with-plus": bad(["+model=gpt_moe"], "model", ["already chooses"], ["model=gpt_moe"]),
}
SLOW = {"more/auto-with-rank-ids"}  # its fix runs the auto-planner, which calibrates the host first (minutes)
if not torch.cuda.is_available():
    MORE["more/cuda-without-a-gpu"] = bad(["device=cuda"], "device", ["no CUDA device"])
    MORE["hardware/gpu-profile-without-a-gpu"] = bad(["hardware=h100_sxm"], "hardware", ["not a dry run"])

_WHICH = "trainer.validate.checks.shutil.which"
HOST: dict[str, tuple[Bad, dict[str, object]]] = {  # (case, {what the validator reads of the host: its value here})
    "host/cxx-not-on-path": (bad(["train.compile=true"], "train.compile", ["$CXX is"]),
                             {"CXX": "no-such-c++", _WHICH: lambda program: None}),
    "host/only-clang": (bad(["train.compile=true"], "train.compile", ["no g++ on PATH"]),
                        {_WHICH: lambda program: "/usr/bin/clang++" if program == "clang++" else None}),
    "host/no-compiler": (bad(["train.compile=true"], "train.compile", ["none was found"]),
                         {_WHICH: lambda program: None}),
    "host/no-mallopt": (bad(["launch.unmap_freed_memory=true"], "launch.unmap_freed_memory", ["mallopt"]),
                        {"trainer.validate.launch_checks.has_mallopt": lambda: False}),
}

_PASSED_ON = "passes on the fix of the error it reports (an HFModelError's, a CustomModelError's, ...), prose there"
PROSE: dict[str, tuple[str, str]] = {
    # phrase of the ConfigIssue(...) source: (file it is in, why its fix names no override)
    "module {name}: only a Shard input": ("layout.py", "the fix is to remove a layout or add placements: the "
                                                       "user's globs"),
    "provides no named plans": ("layout.py", "the user writes placement globs of their own model"),
    "provides no Megatron plan": ("cube.py", "another model (one with a Megatron plan) is the user's choice"),
    '"pass a YAML mapping"': ("checks.py", "a document, not an override, is wrong"),
    "explicit rank ids must form": ("checks.py", "the user's own rank ids: an example, no override"),
    "hold no rank id": ("checks.py", "the user's own rank ids"),
    "are not each of 0..": ("checks.py", "the user's own rank ids"),
    '"use a positive size"': ("checks.py", "the user's own mesh"),
    "is not a valid axis name": ("checks.py", "the user names the axis"),
    "is used twice": ("checks.py", "the user names the axis"),
    "give one name per mesh axis": ("checks.py", "which of dims or mesh is wrong is the user's choice"),
    "takes {want} axis name(s)": ("checks.py", "the user chooses the axes"),
    "names axis {names[0]!r} twice": ("checks.py", "the user chooses the axes"),
    "is used by nothing": ("checks.py", "the user chooses what uses the axis"),
    "other placements beside it are not built": ("grid_checks.py", "the user's own placement globs to remove"),
    "is not in parallel.dims {par.dims}": ("grid_checks.py", "the user chooses the grid's axes"),
    "is already the {role[axis]} axis": ("grid_checks.py", "the user chooses the grid's axes"),
    "has no transformer blocks for the grid": ("grid_checks.py", "another model: its data is the user's choice"),
    "parameters are placed on it by": ("checks.py", "the user's own placement glob"),
    "on a parameter: a parameter's value must be whole": ("checks.py", "the user's own placement glob"),
    "does not split over": ("checks.py", "how many hosts is the user's choice"),
    "explicit rank ids are supported on one host only": ("checks.py", "a mesh shape of the user's choice"),
    "port 0 with launch.nnodes": ("checks.py", "node 0's address is the user's"),
    "workers but only": ("checks.py", "needs a CUDA host; the fix is a mesh or host count of the user's choice"),
    "a top-level one would be ambiguous": ("stage_checks.py", "the user moves a section into a stage"),
    "is not one of this stage's dims": ("stage_checks.py", "the user chooses the stage's axes"),
    "is not a valid, unique axis name": ("stage_checks.py", "the user names the axis"),
    "different axis name(s)": ("stage_checks.py", "the user chooses the axes"),
    "already the stage's data-parallel axis": ("stage_checks.py", "the user chooses the axes"),
    "the stage's data-parallel axis; parameters": ("stage_checks.py", "the user's own placement glob"),
    "must be whole\",": ("stage_checks.py", "the user's own placement glob"),
    "is already the stage's {taken} axis": ("stage_checks.py", "the user chooses the stage's axes"),
    "it splits rows or tokens, not this parameter": ("stage_checks.py", "the user's own placement glob"),
    "is not a non-empty list": ("stages.py", "the user's own rank lists"),
    "give one axis name per axis of the stage": ("stages.py", "the user names the axes"),
    "give every rank to exactly one stage": ("stages.py", "the user's own rank lists"),
    "the ranks decrease along": ("stages.py", "the user's own rank lists"),
    "every stage needs the same": ("stages.py", "the user's own rank lists"),
    "list each boundary once": ("units.py", "the user's own boundaries"),
    "boundar{": ("units.py", "the user's own boundaries (or boundaries: auto)"),
    "use a smaller pp size or stages_per_rank": ("units.py", "a mesh or model of the user's choice"),
    "use one of {": ("units.py", "the model's modules are listed"),
    "list only the first module": ("units.py", "the user's own boundaries"),
    "matches no file": ("files.py", "the user's own files"),
    "give files of one format": ("files.py", "the user's own files"),
    "data.text_field": ("files.py", "the field is named in the user's records"),
    "holds no tokenizer.json": ("chat.py", "the user's own tokenizer"),
    "is plain text; chat data is records": ("chat.py", "the user's own files"),
    "data.messages_field": ("chat.py", "the fields are named in the user's records"),
    "holds no conversation": ("chat.py", "the user's own files"),
    "names plain text files; chat data": ("model_checks.py", "the user's own files"),
    "chat data needs a tokenizer": ("__init__.py", "the user's own tokenizer"),
    "data.eos_token": ("tokenizer.py", "the token is the user's tokenizer's"),
    '"give a tokenizer.json file': ("tokenizer.py", "the user's own tokenizer"),
    "is not a tokenizers file": ("tokenizer.py", "the user's own tokenizer"),
    "is valid and predicted": ("plan.py", "the planner's knobs are the user's choice"),
    "see python -m": ("plan.py", "the planner's knobs are the user's choice"),
    '"model.kwargs", err.reason, err.fix': ("model_checks.py", _PASSED_ON),
    '"model.path", err.reason, err.fix': ("model_checks.py", _PASSED_ON),
    "(config.json) {i.path}": ("model_checks.py", _PASSED_ON),
    'cfg.model.name else "model.builder"': ("model_checks.py", _PASSED_ON),
    "_fix(e, loc, raw)": ("schema_issues.py", "pydantic's range or type: the value is the user's"),
    "the model's embedding only": ("model_checks.py", "a model or tokenizer of the user's choice"),
    "transition table over": ("model_checks.py", "how many symbols, or which order, is the user's choice"),
    "is set as well as data.val_paths": ("model_checks.py", "which split to keep is the user's choice"),
    "its tensors are too large": ("model_checks.py", "model sizes of the user's choice"),
    "remove this glob, and use data or expert": ("expert_checks.py", "the user's own placement globs"),
}
