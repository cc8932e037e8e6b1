"""Chat data (``data=chat``): targets on the assistant's tokens, packed rows whose documents do not
see each other, and a loss averaged over the global batch's targets whatever the slicing."""

from __future__ import annotations

import json

import pytest
import torch

from parallel.errors import ConfigError
from tests.hf_assets import conversations, write_chat_tokenizer, write_chats, write_jsonl, write_tiny_llama
from trainer.config.chat_data import ChatDataConfig
from trainer.data.base import document_positions
from trainer.data.loader import GlobalBatchLoader
from trainer.models import TargetMeanLoss
from trainer.models.layers import document_mask

pytest.importorskip("transformers")

SEQ = 128


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(root / "model", vocab_size=400)
    write_tiny_llama(root / "model", vocab_size=416)
    chats = conversations(30, seed=3, words=(1, 4))
    write_chats(root / "chats.jsonl", chats)
    return root, chats


def _source(assets, **fields):
    from trainer.data.chat import ChatSource

    root, _ = assets
    return ChatSource(ChatDataConfig(paths=[str(root / "chats.jsonl")], **fields), SEQ, tokenizer=str(root / "model"))


def test_targets_are_the_assistant_tokens_counted_independently(assets):
    source = _source(assets)
    _, chats = assets
    tok = source.tok
    # Independently: each assistant turn's content, its end-of-turn marker and the newline after it.
    expected = sum(len(tok(m["content"] + "<|im_end|>\n", add_special_tokens=False)["input_ids"])
                   for chat in chats for m in chat if m["role"] == "assistant")
    assert source.num_cut == 0
    assert sum(source.counts) == expected
    assert int((source.targets != -100).sum()) == expected
    # A target is the next input token wherever it counts; one end-of-turn target per assistant turn.
    alone = _source(assets, packing=False)
    for row, chat in enumerate(chats):
        inputs, targets = alone[row]
        kept = (targets[:-1] != -100) & (inputs[1:] != alone.pad_id)  # the last target has no next input
        assert torch.equal(targets[:-1][kept], inputs[1:][kept])
        ends = tok.decode(targets[targets != -100].tolist()).count("<|im_end|>")
        assert ends == sum(m["role"] == "assistant" for m in chat)


def test_packed_rows_restart_positions_per_conversation_and_pad_the_rest(assets):
    packed, alone = _source(assets), _source(assets, packing=False)
    assert len(packed) < len(alone) == 30  # several conversations share a row
    assert sum(packed.counts) == sum(alone.counts)
    assert alone.positions is None and len(alone[0]) == 2
    starts = int(sum((packed.positions[r] == 0).sum() for r in range(len(packed))))
    assert starts >= 30  # every conversation, plus each row's padding
    # The padding (after the last conversation's start): pad ids, no targets, positions of its own.
    for row in range(len(packed)):
        pad = packed.inputs[row] == packed.pad_id
        if pad[-1]:
            start = int(packed.positions[row].eq(0).nonzero()[-1])
            assert torch.all(pad[start:]) and torch.all(packed.targets[row][start:] == -100)
            assert packed.positions[row][start:].tolist() == list(range(SEQ - start))


def test_train_on_all_and_prompt_completion_records(assets, tmp_path):
    from trainer.data.chat import ChatSource

    root, _ = assets
    everything = _source(assets, train_on="all", packing=False)
    # Every token but each conversation's first is a target (rows are one conversation, padded).
    tok = everything.tok
    lengths = [len(tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"])
               for chat in assets[1]]
    assert everything.counts == [n - 1 for n in lengths]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "the mesh", "completion": "shards every"}) + "\n" for _ in range(3)))
    source = ChatSource(ChatDataConfig(paths=[str(pairs)], packing=False), SEQ, tokenizer=str(root / "model"))
    expected = len(source.tok("shards every<|im_end|>\n", add_special_tokens=False)["input_ids"])
    assert source.counts == [expected] * 3


def test_a_tokenizer_without_template_is_refused_with_a_fix_that_works(assets, tmp_path):
    from trainer.data.chat import ChatSource

    root, _ = assets
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((root / "model" / "tokenizer.json").read_bytes())
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cfg = ChatDataConfig(paths=[str(root / "chats.jsonl")])
    with pytest.raises(ConfigError) as err:
        ChatSource(cfg, SEQ, tokenizer=str(plain))
    (issue,) = err.value.issues
    assert issue.path == "data.template" and issue.fix == "data.template=chatml"
    fixed = ChatSource(cfg.model_copy(update={"template": "chatml"}), SEQ, tokenizer=str(plain))
    assert sum(fixed.counts) == sum(_source(assets).counts)


def test_plain_text_files_are_refused(assets, tmp_path):
    from trainer.data.chat import ChatSource

    root, _ = assets
    write_jsonl(tmp_path / "docs.jsonl", ["no messages here"])
    with pytest.raises(ConfigError) as err:
        ChatSource(ChatDataConfig(paths=[str(tmp_path / "docs.jsonl")]), SEQ, tokenizer=str(root / "model"))
    assert err.value.issues[0].path == "data.messages_field"


def test_document_positions_and_mask():
    eos = 0
    positions = document_positions(torch.tensor([5, 9, eos, 7, 3, eos, eos, 4]), eos)
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    mask = document_mask(torch.tensor([[0, 1, 0, 1, 2]]))[0, 0]
    assert mask.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                             [False, False, True, False, False], [False, False, True, True, False],
                             [False, False, True, True, True]]


def test_loss_over_uneven_slices_is_the_global_target_mean():
    """Slices (ranks, micro-batches, accumulation) averaged as the engine averages them give the sum
    over every target divided once by their count, however unevenly the targets fall."""
    torch.manual_seed(0)
    logits = torch.randn(8, 6, 11)
    targets = torch.randint(0, 11, (8, 6))
    targets[:3, :5] = -100  # the first rows have few targets
    targets[6:, :] = -100  # two rows none
    loss = TargetMeanLoss()
    loss.tokens_per_row = int((targets != -100).sum()) / 8
    global_mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    for slices in (1, 2, 4, 8):
        mean_of_slices = sum(loss(lg, tg) for lg, tg in zip(logits.chunk(slices), targets.chunk(slices))) / slices
        assert torch.allclose(mean_of_slices, global_mean, rtol=1e-6)


def test_loader_counts_the_targets_of_the_whole_global_batch(assets):
    source = _source(assets)
    loaders = [GlobalBatchLoader(source, global_batch_size=4, dp_rank=r, dp_size=2, seed=0) for r in range(2)]
    counts = [loader.target_tokens(4) for loader in loaders]
    shares = [int((loader.next_batch()[1] != -100).sum()) for loader in loaders]
    assert counts[0] == counts[1] == sum(shares)
    assert shares[0] != shares[1]  # uneven across ranks: the per-rank mean would differ


@pytest.mark.parametrize("model", ["gpt_debug", "hf"])
def test_a_packed_document_gives_the_logits_it_gives_alone(assets, model):
    from trainer.config.schema import HFModelConfig, LlamaConfig
    from trainer.models import build_model
    from trainer.models.hf import load_hf_weights, weight_files

    root, _ = assets
    if model == "hf":
        cfg = HFModelConfig(path=str(root / "model"))
        net = build_model(cfg, seed=0)
        load_hf_weights(net, weight_files(cfg.path), tied=False)
    else:
        net = build_model(LlamaConfig(vocab_size=416, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
                          seed=0)
    source = _source(assets)
    worst = 0.0
    with torch.no_grad():
        for row in range(3):
            inputs, _, positions = source[row]
            packed = net(inputs[None], positions=positions[None])[0]
            starts = positions.eq(0).nonzero().flatten().tolist() + [SEQ]
            assert len(starts) >= 3  # two documents or more (and maybe the padding)
            for begin, end in zip(starts[:-1], starts[1:]):
                alone = net(inputs[None, begin:end])[0]
                worst = max(worst, float((packed[begin:end] - alone).abs().max()))
            # Without positions the same row is one sequence: later documents see earlier ones.
            assert float((net(inputs[None])[0] - packed).abs().max()) > 1e-3
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("separator", [True, False])
def test_exact_targets_with_and_without_the_turn_separator(assets, tmp_path, separator):
    """``data.train_on_turn_separator``: ChatML's newline after each assistant ``<|im_end|>`` is a target
    (the default, as TRL's assistant-only masks) or not (as Axolotl's train_on_eos: turn). The mask is
    built here independently, segment by segment of the ChatML text (special tokens split the text)."""
    from trainer.data.chat import ChatSource

    root, _ = assets
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the mesh"},
            {"role": "assistant", "content": "shards every"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "replicate"}]
    write_chats(tmp_path / "one.jsonl", [chat])
    source = ChatSource(ChatDataConfig(paths=[str(tmp_path / "one.jsonl")], packing=False,
                                       train_on_turn_separator=separator), SEQ, tokenizer=str(root / "model"))
    tok = source.tok
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, is_target = [], []
    for m in chat:
        mine = m["role"] == "assistant"
        for piece, target in ((encode("<|im_start|>" + m["role"] + "\n"), False), (encode(m["content"]), mine),
                              (encode("<|im_end|>"), mine), (encode("\n"), mine and separator)):
            ids += piece
            is_target += [target] * len(piece)
    assert ids == encode(tok.apply_chat_template(chat, tokenize=False))  # the segments are the whole text's tokens
    want = [t if keep else -100 for t, keep in zip(ids[1:], is_target[1:])]
    inputs, targets = source[0]
    n = len(ids) - 1
    assert inputs[:n].tolist() == ids[:-1] and targets[:n].tolist() == want
    assert torch.all(targets[n:] == -100)
    newline = encode("\n")[0]
    assert [t for t in want if t != -100].count(newline) == (2 if separator else 0)
