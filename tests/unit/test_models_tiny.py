"""``retool model init-tiny``: a loadable Qwen2 model + byte-level tokenizer, deterministic per seed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from services.models.tiny import MARKUP, init_model_dir


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(init_model_dir(tmp_path / "a", "tiny", seed=1) / "model.safetensors")
    b = load_file(init_model_dir(tmp_path / "b", "tiny", seed=1) / "model.safetensors")
    c = load_file(init_model_dir(tmp_path / "c", "tiny", seed=2) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "norm" not in k)
    tokenizer_json = [(tmp_path / d / "tokenizer.json").read_bytes() for d in "ac"]
    assert tokenizer_json[0] == tokenizer_json[1]


def test_loads_as_qwen2_with_a_working_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = init_model_dir(tmp_path / "m", "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    text = "<code>\nprint(sum(range(10)))\n</code>\n<interpreter>\n45\n</interpreter>\n" \
           "<answer>\\boxed{45}</answer> é ∑ 中"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: everything round-trips
    for tag in MARKUP:
        assert tok.decode(tok.encode(tag, add_special_tokens=False)) == tag
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [tok.eos_token_id]  # one special token
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))


def test_cli_builds_and_rejects_unknown_size(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "services.cli", "model", "init-tiny", "--out",
                         str(tmp_path / "x"), "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "x" / "model.safetensors").is_file()
    assert (tmp_path / "x" / "tokenizer.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "services.cli", "model", "init-tiny", "--out",
                          str(tmp_path / "y"), "--size", "huge"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "size" in bad.stderr and "huge" in bad.stderr
    assert not (tmp_path / "y").exists()


def test_unknown_size_in_api_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="size"):
        init_model_dir(tmp_path / "z", "huge")  # type: ignore[arg-type]


def test_model_files_are_readable_by_other_uids_under_a_strict_umask(tmp_path):
    """The containers run as uid 10001 and read host-written models through a bind mount."""
    old = os.umask(0o077)
    try:
        out = init_model_dir(tmp_path / "m", "tiny", seed=0)
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*")]
    assert any(p.name == "model.safetensors" for p in files)
    for path in [out, *files]:
        mode = stat.S_IMODE(path.stat().st_mode)
        want = 0o555 if path.is_dir() else 0o444
        assert mode & want == want, (path, oct(mode))
        assert not mode & 0o022, (path, oct(mode))  # readable, never made writable by others
