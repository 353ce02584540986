"""``multihead serve`` as a user starts it: a process, flags, SIGTERM with requests in flight."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from multihead import cli
from multihead.bench.texts import sentences
from multihead.serve import Access, ServeOptions, load_engine, open_warning

FP32 = 1e-5  # onnxruntime fp32 against torch fp32 (tests/export)


def _url(process: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if "http://" in line:
            return next(w for w in line.split() if w.startswith("http://"))
        if not line and process.poll() is not None:
            break
    process.kill()
    pytest.fail(f"multihead serve did not start: {process.stderr.read()[-2000:]}")


def _in_flight(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("multihead_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_serve_on_onnx_stops_after_answering_requests_in_flight(pretrained, minilm_onnx):
    command = [sys.executable, "-m", "multihead.cli", "serve", "--port", "0"]
    command += ["--runtime", "onnx", "--onnx", str(minilm_onnx), "--threads", "1"]
    command += ["--max-batch-tokens", "2048", "--max-wait-ms", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _url(process)
        assert url.startswith("http://127.0.0.1:")
        # two requests of 8 texts near 150 tokens: about a second of model time on one thread
        texts = [sentences(8, min_words=100, max_words=140, seed=s) for s in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(httpx.post, url + "/embed", json={"inputs": t}, timeout=120)
                for t in texts
            ]
            deadline = time.monotonic() + 60
            while _in_flight(url) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert [a.status_code for a in answers] == [200, 200]
    for batch, answer in zip(texts, answers):
        assert np.abs(np.array(answer.json()) - pretrained.embed(batch).numpy()).max() <= FP32
    assert "stopped" in process.stdout.read()


def test_serve_bad_flags(capsys):
    assert cli.main(["serve", "--onnx", "model.onnx"]) == 2
    assert "only used with runtime 'onnx'" in capsys.readouterr().err
    assert cli.main(["serve", "--max-batch-tokens", "0"]) == 2
    assert "max_batch_tokens must be a positive int" in capsys.readouterr().err
    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "port must be an int in [0, 65535]" in capsys.readouterr().err
    assert cli.main(["serve", "--threads", "0"]) == 2
    assert "threads must be a positive int" in capsys.readouterr().err


def test_serve_limits_and_access_flags(monkeypatch, capsys):
    """The issue-17 flags reach run(); the key comes from MULTIHEAD_API_KEY when not given."""
    import multihead.serve

    seen: dict = {}

    def run(options: ServeOptions) -> None:
        seen.update(vars(options))

    monkeypatch.setattr(multihead.serve, "run", run)
    monkeypatch.setenv("MULTIHEAD_API_KEY", "from-the-environment")
    argv = ["serve", "--max-response-mb", "4", "--header-timeout", "3", "--body-timeout", "7"]
    argv += ["--drain-timeout", "9", "--allowed-hosts", "a.example", "b.example"]
    argv += ["--cors-origin", "https://app.example"]
    assert cli.main(argv) == 0
    limits, access = seen["limits"], seen["access"]
    assert (limits.max_response_mb, limits.header_timeout_s) == (4, 3)
    assert (limits.body_timeout_s, limits.drain_timeout_s) == (7, 9)
    assert access.api_key == "from-the-environment"
    assert access.allowed_hosts == ("a.example", "b.example")
    assert access.cors_origin == "https://app.example"
    assert cli.main(["serve", "--api-key", "from-the-flag"]) == 0
    assert seen["access"].api_key == "from-the-flag"
    monkeypatch.delenv("MULTIHEAD_API_KEY")
    assert cli.main(["serve"]) == 0 and seen["access"].api_key is None
    assert cli.main(["serve", "--max-response-mb", "0"]) == 2
    assert "max_response_mb must be a positive number" in capsys.readouterr().err
    assert cli.main(["serve", "--drain-timeout", "nan"]) == 2
    assert "drain_timeout_s must be a positive number" in capsys.readouterr().err
    assert cli.main(["serve", "--cors-origin", "app.example"]) == 2
    assert "cors_origin must be '*' or an origin" in capsys.readouterr().err


def test_listening_beyond_loopback_without_a_key_warns():
    open_access = Access(loopback=False)
    for host in ("0.0.0.0", "::", "192.0.2.7", "myhost.example"):
        warning = open_warning(host, open_access)
        assert f"listening on {host}" in warning and "without an API key" in warning
        assert "MULTIHEAD_API_KEY" in warning
        assert open_warning(host, Access(api_key="k", loopback=False)) is None
    for host in ("127.0.0.1", "::1", "localhost"):
        assert open_warning(host, Access()) is None


def test_onnx_runtime_exports_at_start_up(tiny_bert):
    """--runtime onnx without --onnx: the model is exported when the server starts."""
    said: list[str] = []
    engine = load_engine(tiny_bert, runtime="onnx", threads=1, say=said.append)
    assert engine.runtime == "onnx" and engine.backend.onnx.has_weights
    assert "exporting the model to ONNX" in said[0]
    assert engine.model_id == tiny_bert.name and engine.max_input_length == 48
    texts = ["a short text", " ".join(["word"] * 30)]
    tokens = engine.tokenize(texts, truncate=False)
    expected = engine.pretrained.embed(texts, normalize=False).numpy()
    assert np.abs(engine.embed([t.ids for t in tokens]) - expected).max() <= FP32
    with pytest.raises(ValueError, match=r"runtime must be one of \['torch', 'onnx'\]"):
        load_engine(tiny_bert, runtime="tensorrt")
