"""Independent ground truth for the tests: a naive attention formula and mask cases.

Nothing here calls the library's own lowering: every expected mask is written out from the
definitions in docs/design.md ("The mask contract") with numpy index arithmetic.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from multihead import masks


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(D) + bias) V written out, in the dtype of the inputs.

    ``keep`` (bool, broadcastable to (B, H, L, S)) hides keys; rows with no visible key give 0.
    GQA: key/value head h // (H / H_kv) serves query head h. ``softcap``: the scaled scores
    become softcap * tanh(s / softcap) before the bias (Gemma 2). ``sinks`` (H,): one more
    term exp(sinks[h]) in every row's denominator, with no value (gpt-oss).
    """
    h, h_kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // h_kv, dim=1)
    v = v.repeat_interleave(h // h_kv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhld,bhsd->bhls", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if keep is None:
        keep = torch.ones(s.shape, dtype=torch.bool)
    keep = keep.expand(s.shape)
    s = torch.where(keep, s, torch.full_like(s, -torch.inf))
    row_max = s.amax(dim=-1, keepdim=True)
    sink = None if sinks is None else sinks.to(s.dtype)[None, :, None, None]
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.where(keep, torch.exp(s - row_max), torch.zeros_like(s))
    total = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - row_max)
    w = torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)), 0.0)
    return torch.einsum("bhls,bhsd->bhld", w, v), w


@dataclass
class Case:
    """A mask and its expected visibility (B, H, L, S), built independently."""

    mask: masks.Mask | None
    keep: Tensor  # bool [B, H|1, L, S]


def _band(length_q, length_k, before, after, offset):
    i = np.arange(length_q)[:, None] + offset
    j = np.arange(length_k)[None, :]
    ok = np.ones((length_q, length_k), dtype=bool)
    if before is not None:
        ok &= j >= i - before
    if after is not None:
        ok &= j <= i + after
    return ok


def _lens(rng, b, length_k):
    out = rng.integers(0, length_k + 1, size=b)
    out[0] = length_k  # one full row
    if b > 1:
        out[-1] = 0  # one entry with nothing visible
    return out


def _doc_ids(rng, b, n):
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, max(n - 1, 0)), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(n), side="right"))
    return np.stack(rows)


def make_case(name: str, b: int, h: int, length_q: int, length_k: int, seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    br = length_k - length_q

    def band(before, after, offset):
        return _band(length_q, length_k, before, after, offset)[None, None]

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a))

    if name == "none":
        return Case(None, torch.ones(1, 1, length_q, length_k, dtype=torch.bool))
    if name == "causal":
        return Case(masks.causal(), t(band(None, 0, br)))
    if name == "causal_top_left":
        return Case(masks.causal(align="top_left"), t(band(None, 0, 0)))
    if name == "window":
        return Case(masks.sliding_window(3), t(band(3, 0, br)))
    if name == "window_both":
        return Case(masks.sliding_window(2, 4), t(band(2, 4, br)))
    if name == "window_top_left":
        return Case(masks.sliding_window(1, 1, align="top_left"), t(band(1, 1, 0)))
    if name == "lengths":
        n = _lens(rng, b, length_k)
        keep = np.arange(length_k)[None, None, None, :] < n[:, None, None, None]
        return Case(masks.lengths(t(n)), t(keep))
    if name == "lengths_padded_queries":
        n = _lens(rng, b, length_k)
        nq = rng.integers(0, length_q + 1, size=b)
        keep = (np.arange(length_k)[None, None, None, :] < n[:, None, None, None]) & (
            np.arange(length_q)[None, None, :, None] < nq[:, None, None, None]
        )
        return Case(masks.lengths(t(n), query_lens=t(nq)), t(keep))
    if name == "lengths_per_query":
        n = rng.integers(0, length_k + 1, size=(b, length_q))
        keep = np.arange(length_k)[None, None, None, :] < n[:, None, :, None]
        return Case(masks.lengths(t(n)), t(keep))
    if name == "key_padding":
        kp = rng.random((b, length_k)) < 0.6
        if b > 1:
            kp[-1] = False
        return Case(masks.key_padding(t(kp)), t(kp[:, None, None, :]))
    if name == "documents":
        ids = _doc_ids(rng, b, length_q)
        if length_q != length_k:
            kid = _doc_ids(rng, b, length_k)
            keep = ids[:, None, :, None] == kid[:, None, None, :]
            return Case(masks.documents(t(ids), t(kid)), t(keep))
        keep = ids[:, None, :, None] == ids[:, None, None, :]
        return Case(masks.documents(t(ids)), t(keep))
    if name == "dense":
        keep = rng.random((b, h, length_q, length_k)) < 0.5
        return Case(masks.dense(t(keep)), t(keep))
    if name == "dense_2d":
        keep = rng.random((length_q, length_k)) < 0.7
        return Case(masks.dense(t(keep)), t(keep[None, None]))
    if name in COMBOS:
        left, op, right = COMBOS[name]
        x = make_case(left, b, h, length_q, length_k, seed)
        y = make_case(right, b, h, length_q, length_k, seed + 1)
        if op == "&":
            return Case(x.mask & y.mask, x.keep & y.keep)
        return Case(x.mask | y.mask, x.keep | y.keep)
    raise KeyError(name)


COMBOS: dict[str, tuple[str, str, str]] = {
    "causal&lengths": ("causal", "&", "lengths"),
    "documents&causal": ("documents", "&", "causal"),
    "window|key_padding": ("window", "|", "key_padding"),
    "dense&window_both": ("dense", "&", "window_both"),
    "causal_top_left|documents": ("causal_top_left", "|", "documents"),
}

MASK_KINDS = [
    "none",
    "causal",
    "causal_top_left",
    "window",
    "window_both",
    "window_top_left",
    "lengths",
    "lengths_per_query",
    "lengths_padded_queries",
    "key_padding",
    "documents",
    "dense",
    "dense_2d",
    *COMBOS,
]


def qkv(
    b: int,
    h: int,
    h_kv: int,
    length_q: int,
    length_k: int,
    d: int,
    d_v: int | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (
            torch.randn(*shape, generator=g, dtype=torch.float64)
            .to(dtype)
            .requires_grad_(requires_grad)
        )

    return (
        r(b, h, length_q, d),
        r(b, h_kv, length_k, d),
        r(b, h_kv, length_k, d if d_v is None else d_v),
    )


Maker = Callable[..., Case]


def twice_naive_errors(
    run: Callable[[Tensor, Tensor, Tensor], Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None = None,
    grad_out: Tensor | None = None,
    scale: float | None = None,
    *,
    rounded_row_term: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> list[tuple[str, float, float]]:
    """FlashAttention's accuracy rule for half-precision inputs: ``(name, error, bound)`` for
    the output and, with ``grad_out``, the gradients of q, k and v. The rule holds when every
    error <= its bound.

    ``run(q, k, v)`` is the attention under test; q, k, v are bf16/fp16 leaf tensors.
    ``error`` is max |got - ref|, ``bound`` is 2 * max |naive - ref| + floor, where

    - ref is the float64 formula on the *same rounded inputs* (as FlashAttention's tests upcast
      the half tensors they give the kernel). Against the unrounded inputs every kernel is
      charged with the inputs' own rounding, which dominates when the weights are nearly
      one-hot (scale = 10): float64 math on the rounded inputs then misses the truth by 10x
      what the naive bf16 formula happens to, and no kernel can pass;
    - naive is ``naive_attention`` run in the inputs' dtype;
    - floor is one ulp of the dtype at max |ref| (the result is rounded to that dtype once),
      plus float32 roundoff of the terms each entry is summed from: eps32 * (L + S + D) *
      max sum |term| (the textbook bound of a float32 dot product). It matters only where
      ref is 0 by cancellation (dq of a row that sees one key) and the naive formula gets
      that 0 exactly; it is below bf16 resolution by a factor of 2^16 / (L + S + D).

    ``rounded_row_term``: the bound of a kernel whose backward takes FlashAttention's row
    term sum_d dO * O from an output O rounded to the dtype (torch's own scaled dot product
    attention does). That row term is then off by up to eps * sum_d |dO| |O| in row i and
    every score gradient of the row by the weight times that, so dq_i moves by up to
    |scale| * that * sum_j P_ij |k_j| and dk_j by |scale| * sum_i P_ij * that * |q_i|; the
    bound adds these. It is not small where weights are nearly one-hot (scale = 10), where
    the naive formula's own error is tiny: dq up to 60x the naive error was measured there.

    ``softcap`` and ``sinks`` go to every formula (``naive_attention``, which computes the sink
    logits in each formula's dtype); the cap's derivative is at most 1, so the magnitudes of
    the gradient terms stay bounds with it.
    """
    modifiers = {"softcap": softcap, "sinks": sinks}
    dtype = q.dtype
    h, h_kv = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    wide = [t.detach().double().requires_grad_(grad_out is not None) for t in (q, k, v)]
    low = [t.detach().clone().requires_grad_(grad_out is not None) for t in (q, k, v)]
    results = [run(*leaves), naive_attention(*wide, keep, scale=scale, **modifiers)[0]]
    results.append(naive_attention(*low, keep, scale=scale, **modifiers)[0])
    got, ref, naive = ([r] for r in results)
    if grad_out is not None:
        grad_out = grad_out.to(dtype)  # rounded like the inputs, for ref too
        got += torch.autograd.grad(got[0], leaves, grad_out)
        ref += torch.autograd.grad(ref[0], wide, grad_out.double())
        naive += torch.autograd.grad(naive[0], low, grad_out)
    # magnitudes of the terms: the formulas with every operand replaced by its absolute value
    wide_values = (t.detach().double() for t in (q, k, v))
    weights = naive_attention(*wide_values, keep, scale=scale, **modifiers)[1]
    kd, vd = (t.detach().double().repeat_interleave(h // h_kv, dim=1).abs() for t in (k, v))
    terms = [weights @ vd]
    if grad_out is not None:
        go = grad_out.double().abs()
        ds = weights * (go @ vd.transpose(-2, -1))
        ds = abs(scale) * (ds + ds.sum(-1, keepdim=True) * weights)
        fold = (lambda t: t.unflatten(1, (h_kv, h // h_kv)).sum(2)) if h != h_kv else None
        dk = ds.transpose(-2, -1) @ q.detach().double().abs()
        dv = weights.transpose(-2, -1) @ go
        terms += [ds @ kd, *(fold(t) if fold else t for t in (dk, dv))]
        if rounded_row_term:
            out64 = ref[0].detach().abs()  # [B, H, L, D_v]
            slip = torch.finfo(dtype).eps * (go * out64).sum(-1, keepdim=True)  # [B, H, L, 1]
            extra_dq = abs(scale) * slip * (weights @ kd)
            extra_dk = abs(scale) * (weights * slip).transpose(-2, -1) @ q.detach().double().abs()
            extra = [0.0, extra_dq.max(), (fold(extra_dk) if fold else extra_dk).max(), 0.0]
    n = q.shape[2] + k.shape[2] + q.shape[3]
    if not rounded_row_term or grad_out is None:
        extra = [0.0] * 4
    out = []
    got, ref, naive = ([t.detach().double() for t in ts] for ts in (got, ref, naive))
    for name, g, r, m, t in zip(("out", "dq", "dk", "dv"), got, ref, naive, terms):
        floor = torch.finfo(dtype).eps * r.abs().max() + torch.finfo(torch.float32).eps * n * (
            t.max() if t.numel() else 0.0
        )
        error = (g - r).abs().max() if r.numel() else 0.0
        naive_error = (m - r).abs().max() if r.numel() else 0.0
        out.append((name, float(error), float(2 * naive_error + floor + extra[len(out)])))
    return out


def train_quick(task: str, tmp_path_factory, *extra: str) -> tuple:
    """``multihead train TASK --quick`` into a fresh folder: (the folder, what it printed).

    In fp32 unless ``extra`` says otherwise: ``--precision auto`` times the machine's matmuls,
    and on a loaded machine that timing can pick bf16, which tests comparing a run's metrics
    with an fp32 recomputation must not depend on."""
    import contextlib
    import io

    from multihead.cli import main

    out = tmp_path_factory.mktemp(task)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        precision = [] if "--precision" in extra else ["--precision", "fp32"]
        args = ["train", task, "--quick", "--out", str(out), *precision, *extra, "--no-progress"]
        assert main(args) == 0
    return out, printed.getvalue()


def assert_run_summary(trained: tuple) -> None:
    """``assert_summary`` of a ``train_quick`` run, against the metrics.json it wrote."""
    import json

    out, printed = trained
    assert_summary(json.loads((out / "metrics.json").read_text()), printed, out)


def assert_summary(metrics: dict, printed: str, out) -> None:
    """What ``multihead train`` printed at the end holds every test metric of metrics.json,
    one row per contender under its domain or series, with the best value of each column
    starred (larger is better but for errors), and ends with the folder written."""
    groups = {"test set": metrics.get("metrics")}
    for key in ("domains", "series"):
        groups.update({k: v["metrics"] for k, v in metrics.get(key, {}).items()})
    lines = printed.rstrip("\n").splitlines()
    assert lines[-1] == f"wrote {out}"
    checked = 0
    for name, table in groups.items():
        if table is None:
            continue
        start = lines.index(name)
        rows = {}
        for line in lines[start + 2 :]:
            if not line.strip():
                break
            rows[line.split()[0]] = line.split()[1:]
        for contender, values in table.items():
            numbers = {
                m: v
                for m, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            columns = sorted(numbers)
            for i, m in enumerate(columns):
                cell = rows[contender][i]
                assert cell.rstrip("*") == f"{numbers[m]:.3f}", (name, contender, m, cell)
                lower = m in ("mae", "mase")
                pick = min if lower else max
                best = pick(t[m] for t in table.values() if isinstance(t.get(m), (int, float)))
                assert cell.endswith("*") == (numbers[m] == best), (name, contender, m)
                checked += 1
    assert checked >= 3


def walk_parsers(parser, name: str = "multihead"):
    """Every (full command name, parser) of an argparse command line, sub-commands included
    (walked here, independently of the docs hook's own walk)."""
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from walk_parsers(child, f"{name} {sub}")


# ---------------------------------------------------------------------------------------------
# data sets: a file server on 127.0.0.1 and the VADER ground truth for the tests that train on it


@contextlib.contextmanager
def serve_files(files: dict[str, bytes], *, cut: dict[str, int] | None = None):
    """An HTTP server on 127.0.0.1 answering ``GET /NAME`` with ``files[NAME]`` (404 for any
    other name); for a name in ``cut`` it announces the whole length but closes the
    connection after ``cut[NAME]`` bytes. Yields (base URL, the paths asked for)."""
    import http.server
    import threading

    asked: list[str] = []
    cut = cut or {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.lstrip("/")
            asked.append(name)
            if name not in files:
                self.send_error(404)
                return
            body = files[name]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: cut.get(name, len(body))])
            self.close_connection = True

        def log_message(self, *args):  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def shared_vader() -> Path | None:
    """``../shared/data/vader-sentiment`` beside the checkout or a folder above it (CI and
    the main checkout have it), else None."""
    for parent in Path(__file__).resolve().parents[1].parents:
        found = parent / "shared" / "data" / "vader-sentiment"
        if found.is_dir():
            return found
    return None


def vader_folder() -> Path:
    """The VADER ground truth for the tests that train on it: the cache's copy; else the
    cache filled by ``multihead data download vader --from`` a server on 127.0.0.1 serving
    ``../shared/data/vader-sentiment`` (a local mirror); else by the same command from the
    public source. Skipped only when neither the mirror nor the network is there."""
    import io

    from multihead import data
    from multihead.cli import main

    if not data.missing("vader"):
        return data.folder("vader")
    mirror = shared_vader()
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        if mirror is None:
            code = main(["data", "download", "vader"])
        else:
            files = {f.name: (mirror / f.name).read_bytes() for f in data.DATASETS["vader"].files}
            with serve_files(files) as (url, _):
                code = main(["data", "download", "vader", "--from", url])
    if code != 0 and mirror is None:
        pytest.skip(
            "the VADER ground truth is not in the cache, there is no ../shared/data beside "
            "the checkout and the public source did not answer; run "
            f"`multihead data download vader` once. ({said.getvalue().strip()})"
        )
    assert code == 0, said.getvalue()
    return data.folder("vader")


def llama_decoder(layers: int = 2, e: int = 32, h: int = 4, h_kv: int = 2, d: int = 8):
    """A Llama-style decoder stack (rotary GQA attention, SwiGLU of width 48, RMSNorm), with
    torch's default initialization (seed it first)."""
    import multihead as mh

    blocks = [
        mh.TransformerDecoderLayer(
            mh.MultiHeadAttention(
                e, h, num_kv_heads=h_kv, bias=False, rotary=mh.RotaryEmbedding(d)
            ),
            mh.GatedFeedForward(e, 48),
            norm1=mh.RMSNorm(e),
            norm2=mh.RMSNorm(e),
        )
        for _ in range(layers)
    ]
    return mh.TransformerDecoder(blocks, norm=mh.RMSNorm(e))
