"""The HTTP API: TEI and OpenAI embeddings, attention weights, the head view, health, metrics.

``create_app`` wires the parts together: the handlers (``handlers.py``, one module-level
function per route), the state they share (``state.py``: limits, model thread, batcher,
admission, drain deadline) and the checks before the handlers (Host, API key, content type,
body size and deadline: ``guard.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from .._extras import require
from .engine import Engine
from .guard import METHODS, Access, Guard
from .state import ClientError, Limits, ServeState

__all__ = ["ClientError", "Limits", "create_app"]


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """Starts the app's batcher; at shutdown (uvicorn has let the requests in flight finish
    before) ends the drain deadline, the batcher and the model thread."""
    state: ServeState = app.state.serve
    state.start()
    try:
        yield
    finally:
        await state.stop()


def create_app(engine: Engine, limits: Limits | None = None, access: Access | None = None) -> Any:
    """The ASGI app (Starlette) serving ``engine``; run it with uvicorn (see ``serve.run``).

    The model runs on one worker thread; tokenization and JSON on Starlette's thread pool; the
    event loop only checks, batches and answers. ``access`` (default: loopback Host names
    only, no API key, no CORS) is enforced by the ``Guard`` around the app. ``app.drain()``
    starts the shutdown's drain deadline (``serve.server`` calls it on SIGTERM).
    ``app.state.serve`` is the ``ServeState`` every handler receives.
    """
    require("starlette", "serve", "multihead serve")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    from . import handlers

    state = ServeState(engine, limits or Limits(), access or Access())
    app = Starlette(
        routes=[
            Route(path, handlers.endpoint(handler), methods=[METHODS[path]])
            for path, handler in handlers.HANDLERS.items()
        ],
        exception_handlers={ClientError: handlers.client_error, HTTPException: handlers.http_error},
        lifespan=lifespan,
    )
    app.state.serve = state
    app.state.engine, app.state.limits, app.state.metrics = engine, state.limits, state.metrics
    app.state.batcher, app.state.access, app.state.drain = state.batcher, state.access, state.drain
    return Guard(app, state.limits, state.access, state.metrics)
