"""Servers for the service tests: real uvicorn on 127.0.0.1, free ports, stopped at the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest

from multihead.serve import Background, Engine, Limits, create_app


class GatedEngine(Engine):
    """The real engine, except that each model call first waits for ``gate`` to open, so a
    test can hold requests in flight for as long as it needs. ``calls`` records the number of
    texts of every model call, in order."""

    def __init__(self, pretrained) -> None:
        super().__init__(pretrained)
        self.gate = threading.Event()
        self.calls: list[int] = []

    def embed(self, ids):
        self.calls.append(len(ids))
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        return super().embed(ids)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    """Poll a condition every 10 ms; fail the test after ``timeout`` seconds."""

    def wait(condition: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"condition not reached within {timeout} s")
            time.sleep(0.01)

    return wait


@pytest.fixture(scope="module")
def engine(pretrained):
    engine = Engine(pretrained)
    # the first model call of a process picks its attention backends (seconds on a busy
    # machine): done here, it cannot eat into a request's client timeout
    engine.embed([[101, 2023, 102]])
    engine.attention([101, 2023, 102])
    return engine


@pytest.fixture(scope="module")
def server(engine):
    """One server with the default limits for the module's tests."""
    app = create_app(engine, Limits())
    with Background(app) as running:
        running.app = app
        yield running


@pytest.fixture
def gated(pretrained):
    """``with gated(limits) as (engine, app, running)``: a server over a ``GatedEngine``; the
    gate is opened before the server stops, so nothing is left waiting."""

    @contextmanager
    def start(limits: Limits):
        engine = GatedEngine(pretrained)
        app = create_app(engine, limits)
        running = Background(app)
        with running:
            try:
                yield engine, app, running
            finally:
                engine.gate.set()

    return start
