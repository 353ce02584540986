"""Memory of ``multihead serve`` under a long, bounded load: does its RSS level off?

Not a test (pytest does not collect it: a full run takes minutes). It starts ``multihead serve``
as a process on 127.0.0.1, sends a fixed number of requests from a few client threads (embed,
OpenAI embeddings, attention and malformed bodies, texts of varied length so the model sees
many shapes) and prints the server's resident memory every ``--every`` requests. It stops at
``--requests`` or after ``--max-seconds``, whichever comes first.

    python tests/serve/soak.py --requests 12000 --clients 8 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from multihead.bench.texts import sentences


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def requests_cycle(seed: int):
    """An endless, deterministic mix of requests: (path, json body)."""
    short = sentences(512, min_words=3, max_words=60, seed=seed)
    long = sentences(64, min_words=80, max_words=180, seed=seed + 1)
    for i in itertools.count():
        kind = i % 10
        if kind < 5:
            yield "/embed", {"inputs": short[i % 512 : i % 512 + 1 + i % 8]}
        elif kind < 7:
            yield "/v1/embeddings", {"input": [long[i % 64], short[i % 512]], "model": f"m{i}"}
        elif kind == 7:
            yield "/attention", {"inputs": short[i % 512], "layers": [i % 6], "heads": [0, 5]}
        elif kind == 8:
            yield "/embed", {"inputs": long[i % 64], "truncate": True}
        else:
            yield "/embed", {"inputs": [], "note": f"malformed {i}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--every", type=int, default=1000, help="print RSS every N requests")
    parser.add_argument("--max-seconds", type=float, default=900)
    args = parser.parse_args(argv)

    command = [sys.executable, "-m", "multihead.cli", "serve", "--port", "0"]
    command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        url = ""
        deadline = time.monotonic() + 120
        while not url and time.monotonic() < deadline:
            line = server.stdout.readline()
            url = next((w for w in line.split() if w.startswith("http://")), "")
        if not url:
            raise RuntimeError("multihead serve did not start within 120 s")
        lock = threading.Lock()
        done = {"count": 0, "errors5xx": 0, "other": 0}
        stop_at = time.monotonic() + args.max_seconds
        start = time.monotonic()
        print(f"requests={0:>6} rss_mb={rss_mb(server.pid):8.1f} t_s=0", flush=True)

        def client(seed: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                for path, body in requests_cycle(seed):
                    with lock:
                        if done["count"] >= args.requests or time.monotonic() > stop_at:
                            return
                    status = http.post(path, json=body).status_code
                    with lock:
                        done["count"] += 1
                        done["errors5xx"] += status >= 500
                        done["other"] += status not in (200, 422) and status < 500
                        count = done["count"]
                    if count % args.every == 0:
                        elapsed = time.monotonic() - start
                        print(
                            f"requests={count:>6} rss_mb={rss_mb(server.pid):8.1f} "
                            f"t_s={elapsed:.0f}",
                            flush=True,
                        )

        threads = [threading.Thread(target=client, args=(s,)) for s in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"done: {done}", flush=True)
        return 1 if done["errors5xx"] else 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
