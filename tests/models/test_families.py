"""Model families register themselves: ``multihead.models.load`` opens a folder by its
config.json (``model_type``, or ``format_version`` for ``multihead.save`` folders) and imports
only the family that folder names; ``multihead.models.register`` adds a family from outside."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decoders import build
from torch import nn

import multihead as mh
from multihead import io, models
from multihead.models import families

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("bert", "gpt2", "llama", "causal_lm")


def _run(code: str) -> str:
    """``code`` in a fresh interpreter (nothing imported yet) with this checkout first on the
    path; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "", "MULTIHEAD_FUSED_AUTO": "0"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def restore_families():
    """Registrations made by a test are undone after it (the registry is process-wide); the
    built-in families are registered first, so the restore keeps them."""
    models.all_families()
    before = dict(families._FAMILIES)
    yield
    families._FAMILIES.clear()
    families._FAMILIES.update(before)


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {kind: build(kind, root / kind) for kind in ("gpt2", "llama")}


def test_import_multihead_imports_no_family_and_no_checkpoint_library():
    """``import multihead`` imports nothing heavy; its first name used imports what that name
    needs (the model registry for ``load``), and still no family."""
    out = _run(
        "import sys, multihead\n"
        "wanted = lambda: sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'tokenizers', 'safetensors') and '.' not in m "
        "or m.startswith('multihead.models.'))\n"
        "print(wanted())\n"
        "multihead.load\n"
        "print(wanted())"
    )
    assert out.splitlines() == ["[]", "['multihead.models.families']"]


def test_load_imports_only_the_family_the_folder_names(decoders, tmp_path):
    """A fresh process opens a GPT-2 folder and a multihead.save folder of a Llama: each
    family's module is imported when its folder asks for it, and no other."""
    from multihead.models import llama

    mh.save(llama.load(decoders["llama"]), tmp_path / "saved-llama")
    out = _run(
        "import sys, multihead\n"
        f"a = multihead.models.load({str(decoders['gpt2'])!r})\n"
        "print(type(a).__name__, 'multihead.models.llama' in sys.modules, "
        "'multihead.models.bert' in sys.modules)\n"
        f"b = multihead.load({str(tmp_path / 'saved-llama')!r})\n"
        "print(type(b).__name__, 'multihead.models.bert' in sys.modules)\n"
    )
    assert out.split() == ["GPT2", "False", "False", "Llama", "False"]


def test_load_opens_each_kind_by_its_config(decoders, tiny_bert, tmp_path):
    """Same model, same outputs as the family's own loader; multihead.load is the same
    function."""
    from multihead.models import bert, gpt2, llama

    assert mh.load is models.load
    ids = torch.tensor([[5, 17, 42, 7, 99]])
    for kind, family in (("gpt2", gpt2), ("llama", llama)):
        ours, theirs = models.load(decoders[kind]), family.load(decoders[kind])
        assert type(ours) is type(theirs) and ours.tokenizer is not None
        with torch.inference_mode():
            torch.testing.assert_close(ours(ids), theirs(ids), rtol=0, atol=0)
    encoder = models.load(tiny_bert)
    assert isinstance(encoder, bert.Pretrained) and encoder.embed_length == 48
    torch.testing.assert_close(
        encoder.embed(["a short text"]),
        bert.load(tiny_bert).embed(["a short text"]),
        rtol=0,
        atol=0,
    )
    layer = mh.MultiHeadAttention(8, 2)
    back = models.load(mh.save(layer, tmp_path / "layer"))
    assert type(back) is mh.MultiHeadAttention
    for name, value in layer.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


class _Toy(nn.Module):
    """A family defined outside the library: one linear layer, its size in config.json."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)


def _load_toy(folder: Path) -> _Toy:
    config = json.loads((folder / "config.json").read_text())
    model = _Toy(config["width"])
    model.load_state_dict(torch.load(folder / "toy.pt", weights_only=True))
    return model.eval()


def test_register_adds_a_family_from_outside(tmp_path, restore_families):
    torch.manual_seed(0)
    toy = _Toy(3)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy", "width": 3}))
    torch.save(toy.state_dict(), tmp_path / "toy.pt")
    with pytest.raises(ValueError, match=r"model_type 'toy'"):
        models.load(tmp_path)
    models.register(models.Family("toy", "a toy", _Toy, _load_toy))
    assert "toy" in models.supported()
    back = mh.load(tmp_path)
    assert isinstance(back, _Toy) and not back.training
    assert torch.equal(back.linear.weight, toy.linear.weight)
    # a later registration replaces
    models.register(models.Family("toy", "a toy", _Toy, lambda folder: "replaced"))
    assert models.load(tmp_path) == "replaced"


def test_a_registration_from_outside_outlives_the_family_import(restore_families):
    """A built-in family imported after a user registered its model_type keeps the user's."""

    mine = models.Family("bert", "mine", nn.Module, lambda folder: "mine")
    families.register(mine)
    builtin = models.Family("bert", "built-in", nn.Module, lambda folder: "built-in")
    families.register_builtin(builtin)
    assert models.family("bert") is mine


def test_an_unknown_kind_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(
        ValueError,
        match=r"holds a 't5' model \(config.json model_type 't5'\).*"
        r"opens model_type 'bert', 'gpt2', 'llama' and multihead.save folders.*"
        r"multihead.models.register.*Received: model_type='t5'",
    ):
        models.load(tmp_path)


def test_folders_of_no_kind_or_missing_files_are_named(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(ValueError, match="the field format_version is missing"):
        models.load(tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        models.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        models.load(tmp_path)


def test_multihead_io_load_points_hugging_face_folders_to_models_load(tiny_bert):
    with pytest.raises(ValueError, match=r"opens with multihead.models.load.*Received: fields"):
        io.load(tiny_bert)


@pytest.mark.parametrize(
    ("model_type", "loader", "error", "match"),
    [
        (
            3,
            _load_toy,
            ValueError,
            r"model_type must be a non-empty string.*Received: model_type=3",
        ),
        ("", _load_toy, ValueError, r"non-empty string.*Received: model_type=''"),
        ("toy", "a loader", TypeError, r"load must be callable.*Received: str 'a loader'"),
    ],
)
def test_a_family_refuses_bad_fields(model_type, loader, error, match):
    with pytest.raises(error, match=match):
        models.Family(model_type, "a toy", _Toy, loader)


def test_register_takes_a_family_record(restore_families):
    with pytest.raises(TypeError, match=r"register takes a multihead.models.Family record"):
        models.register("toy")


def test_library_classes_declare_saving_in_their_own_files():
    """Each saveable library class carries ``@saveable`` in the file that defines it (io.py
    wraps no class from afar), and every one of them is saved under its public name."""
    import inspect

    from multihead._saveable import DECLARED

    assert len(DECLARED) >= 11
    for name, cls in DECLARED.items():
        assert name == f"multihead.{cls.__name__}"
        source = Path(inspect.getsourcefile(sys.modules[cls.__module__])).read_text()
        assert f'@saveable("{name}")\nclass {cls.__name__}(' in source, name
    io_source = (ROOT / "multihead" / "io.py").read_text()
    assert "__init__ =" not in io_source and "from . import __version__" not in io_source


def test_the_version_lives_in_one_place(tmp_path):
    from multihead._version import __version__

    assert mh.__version__ == __version__ == "0.2.0"
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; the lines suffice
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "multihead._version.__version__" }' in pyproject
    assert '\nversion = "' not in pyproject  # no literal version beside it
    saved = mh.save(mh.RMSNorm(4), tmp_path / "norm")
    assert json.loads((saved / "config.json").read_text())["multihead_version"] == "0.2.0"


@pytest.mark.parametrize("command", ["embed", "explain"])
def test_a_saved_bare_bert_is_refused_by_text_commands(tiny_bert, tmp_path, capsys, command):
    """A multihead.save folder of the Bert module alone says model_type 'bert' but has no
    tokenizer: the text commands name what it holds instead of failing inside the model."""
    from multihead import cli
    from multihead.models import bert

    bare = mh.save(bert.load(tiny_bert).model, tmp_path / "bare")
    (tmp_path / "lines.txt").write_text("one line\n")
    args = {
        "embed": ["embed", str(tmp_path / "lines.txt"), "--out", str(tmp_path / "e.npy")],
        "explain": ["explain", "a text", "--out", str(tmp_path / "x")],
    }[command]
    assert cli.main([*args, "--model", str(bare)]) == 2
    err = capsys.readouterr().err
    assert re.search(
        rf"holds a multihead.save folder of Bert, a model without its tokenizer, but "
        rf"multihead {command} supports sentence encoders: a BERT-family encoder.*"
        r"Received: multihead.models.bert.Bert",
        err,
    ), err
