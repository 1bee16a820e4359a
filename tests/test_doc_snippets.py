"""The Python snippets of README.md and docs/integrations.md run as written, in a fresh process
as a user pastes them (no TRITON_INTERPRET: the CPU's chunked path). The README's two loss
snippets run on their own; the Hugging Face snippets of integrations.md get the names they
assume (a tiny random Qwen2, its reference copy and a padded batch) from a prelude. The TRL
snippets, which download a model, are left out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

PRELUDE = """
import copy
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).eval()
ref_model = copy.deepcopy(model).requires_grad_(False)
B, P, T = 4, 5, 6
ids = torch.randint(1, 64, (B, P + T))
completion_mask = torch.ones(B, T)
completion_mask[1, 4:] = 0
completion_mask[2, 1:] = 0
attention_mask = torch.ones_like(ids)
attention_mask[0, :2] = 0                               # a left-padded prompt
attention_mask[:, P:] = completion_mask.long()
advantages = torch.randn(B)
"""


def blocks(doc: str, section: str | None = None) -> list[str]:
    text = (REPO / doc).read_text()
    if section is not None:
        start = text.index(section)
        text = text[start:text.index("\n## ", start + 1)]
    return [b for b in _BLOCK.findall(text) if "trl" not in b]


def run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def test_readme_snippets_run_and_packed_equals_padded():
    padded, packed = blocks("README.md")
    check = ("padded_loss = loss.item()\n" + packed +
             "\nassert abs(loss.item() - padded_loss) <= 1e-6 * max(1.0, abs(padded_loss))"
             "\nprint('ok')\n")
    out = run(padded + check)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok"), out.stdout


def test_integrations_hugging_face_snippets_run():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hf = blocks("docs/integrations.md", "## Hugging Face causal LMs, plain PyTorch")
    lora = blocks("docs/integrations.md", "## LoRA on the output head (PEFT)")
    assert len(hf) == 2 and len(lora) == 1
    padded, packed = hf
    check = ("padded_loss = loss.item()\n" + packed +
             "\nassert abs(loss.item() - padded_loss) <= 1e-5 * max(1.0, abs(padded_loss))\n")
    out = run(PRELUDE + padded + check + lora[0] + "\nloss.backward()\nprint('ok')\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok"), out.stdout
