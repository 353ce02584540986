"""``multihead generate`` on transformers' models (a GGUF file, a transformers folder of an
architecture the library has no decoder for): the streamed text against transformers' own
``generate()`` on its eager attention, decoded by hand (the independent reference); and what
``--chat`` refuses. The library's own decoders are tested in tests/apps/test_lm.py."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import transformers
from hf.tiny_gguf import write_gguf
from models.decoders import build, write_tokenizer

from multihead.apps import generate
from multihead.cli import main

PROMPT = "The movie was"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("llama"), layers=2)


@pytest.fixture(scope="module")
def gguf_file(llama, tmp_path_factory):
    return write_gguf(llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A Qwen2 folder: an architecture multihead.models has no family for."""
    folder = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # peaked logits: greedy choices far from ties
        bos_token_id=1,
        eos_token_id=0,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    write_tokenizer(folder, bos=True)
    return folder


def _generate(*args: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generate", *args]) == 0
    return printed.getvalue()


def _eager_greedy(folder, n: int) -> str:
    """transformers' greedy continuation of PROMPT on its eager attention, decoded whole."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer(PROMPT, return_tensors="pt")
    out = model.eval().generate(**prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["gguf_file", "qwen2"])
def test_a_transformers_model_streams_its_greedy_continuation(kind, request, llama, qwen2):
    source = request.getfixturevalue(kind)
    pieces: list[str] = []
    options = generate.GenerateOptions(prompt=PROMPT, model=str(source), max_new_tokens=12)
    whole = generate.run(options, write=pieces.append)
    assert whole.strip() and whole == _eager_greedy(llama if kind == "gguf_file" else qwen2, 12)
    assert "".join(pieces) == whole + "\n"
    assert len([p for p in pieces if p.strip()]) >= 2  # piece by piece, not at the end


def test_sampling_is_reproducible_under_a_seed(qwen2):
    args = ["--model", str(qwen2), PROMPT, "--temperature", "1.5", "--max-new-tokens", "12"]
    a = _generate(*args, "--seed", "7")
    assert a == _generate(*args, "--seed", "7")
    assert any(_generate(*args, "--seed", str(s)) != a for s in range(8, 12))


def test_chat_without_a_chat_template_is_refused(qwen2, capsys):
    assert main(["generate", "--model", str(qwen2), "--chat", "hi"]) == 2
    assert "--chat needs the model's chat template" in capsys.readouterr().err


def test_chat_is_refused_for_the_librarys_own_decoders(llama, capsys):
    assert main(["generate", "--model", str(llama), "--chat", "hi"]) == 2
    assert "--chat needs a chat template, which multihead's own decoders" in (
        capsys.readouterr().err
    )


def test_a_bad_model_is_named(tmp_path, capsys):
    assert main(["generate", "--model", "smolm2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "is not a folder, a .gguf file or one of those names" in err
    assert "Received: source='smolm2'" in err


def test_a_piped_prompt_is_read_from_standard_input(qwen2, monkeypatch):
    # the shell's pipe in a process of its own: no PROMPT at all; '-' in this process
    import subprocess
    import sys

    args = ["--model", str(qwen2), "--max-new-tokens", "8"]
    want = _generate(*args, PROMPT)
    done = subprocess.run(
        [sys.executable, "-m", "multihead.cli", "generate", *args],
        input=PROMPT + "\n", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == want
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    assert _generate(*args, "-") == want


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_prompt_on_a_terminal_says_how_to_give_one(qwen2, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", _Terminal(""))
    assert main(["generate", "--model", str(qwen2)]) == 2
    err = capsys.readouterr().err
    assert "give the text to continue as PROMPT, or pipe it in" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert main(["generate", "--model", str(qwen2), "-"]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    assert generate.read_prompt("hi", _Terminal("")) == "hi"
