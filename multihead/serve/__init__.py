"""``multihead serve``: an HTTP service for sentence embeddings and attention weights.

Starlette on uvicorn. Endpoints: ``POST /embed`` (text-embeddings-inference's format),
``POST /v1/embeddings`` (OpenAI's), ``POST /attention``, ``GET /view``, ``GET /health``,
``GET /info`` and ``GET /metrics`` (Prometheus). Concurrent requests are packed into batches
bounded by a token budget and a short wait; the model runs off the event loop. The service
keeps no state between requests, so replicas scale behind any load balancer.

Needs the ``serve`` extra (starlette, uvicorn, prometheus-client), imported only when used.
"""

from __future__ import annotations

from .app import create_app
from .engine import Engine, Tokens, TooLong
from .guard import Access
from .server import RUNTIMES, Background, ServeOptions, bind, load_engine, open_warning, run
from .state import ClientError, Limits, ServeState

__all__ = [
    "RUNTIMES",
    "Access",
    "Background",
    "ClientError",
    "Engine",
    "Limits",
    "ServeOptions",
    "ServeState",
    "Tokens",
    "TooLong",
    "bind",
    "create_app",
    "load_engine",
    "open_warning",
    "run",
]
