"""docs/fine-tuning.md's chat fine-tuning, as a user types it: ``+recipe=finetune model=hf data=chat`` on a
conversation file, then ``python -m trainer.generate CKPT --chat`` answers with what it learned.

The model (tiny, random weights) learns one reply by heart; greedy decoding must give it back word
for word, after the chat template's generation prompt, ending at the end-of-turn token.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import run_cli
from tests.hf_assets import write_chat_tokenizer, write_chats, write_tiny_llama
from timing import scaled

pytestmark = pytest.mark.slow

REPLY = "between the stages"


def test_finetune_on_chats_then_chat_with_the_checkpoint(tmp_path):
    write_chat_tokenizer(tmp_path / "model", vocab_size=400)
    write_tiny_llama(tmp_path / "model", vocab_size=416)
    chat = [{"role": "user", "content": "where do activations go"}, {"role": "assistant", "content": REPLY}]
    write_chats(tmp_path / "chats.jsonl", [chat] * 16)
    run = run_cli(["+recipe=finetune", "model=hf", f"model.path={tmp_path / 'model'}", "data=chat",
                   f"data.paths=[{tmp_path / 'chats.jsonl'}]", "data.val_fraction=0.25", "train.seq_len=64",
                   "train.steps=30", "optim.lr=3e-3", "train.global_batch_size=4", "tracking=none"],
                  cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # 16 conversations of 26 tokens, packed two to a row of 64; the targets: the reply's 4 tokens and "<|im_end|>\n".
    assert "data: 16 conversations -> 8 rows of 64 (packed)" in run.stdout, run.stdout
    val = [float(line.split("val_loss ")[1].split()[0]) for line in run.stdout.splitlines() if "val_loss" in line]
    assert len(val) == 2 and val[-1] < 0.5 * val[0], val  # step 0 (weights loaded) and the end, on the reply
    answer = subprocess.run([sys.executable, "-m", "trainer.generate", "checkpoints/step_00000030", "--chat",
                             "where do activations go", "--temperature", "0"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=scaled(300))
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == REPLY
    # A raw-text prompt on a chat run points at --chat.
    prompt = subprocess.run([sys.executable, "-m", "trainer.generate", "checkpoints/step_00000030", "--prompt", "x"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=scaled(300))
    assert prompt.returncode == 2 and "--chat" in prompt.stderr
