"""``multihead train forecast``: a causal-attention forecaster on two real series shipped inside
statsmodels, the weekly Mauna Loa CO2 record and yearly sunspot numbers.

The tail of each series (one horizon) is held out. The model reads a context window, one token
per time step, under ``masks.causal()``; every position predicts the next ``horizon`` values, so
one window trains every position at once and position t never sees a value after t. The
forecast is the last position's prediction. Baselines on the same split: the seasonal-naive
forecast (repeat the last season), a direct linear model on the same context (the lesson of
Zeng et al. 2023, "Are Transformers Effective for Time Series Forecasting?") and statsmodels'
``AutoReg``. Metrics: MAE and MASE (MAE over the training set's in-sample seasonal-naive MAE,
Hyndman & Koehler 2006).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import masks
from ..io import register, save
from ..modules import SinusoidalPositionalEncoding, TransformerEncoder, TransformerEncoderLayer
from .common import Options, figure, finish, need, save_figure, seed_everything, training_curve
from .loop import Dist, FitResult, fit

__all__ = ["SERIES", "CausalForecaster", "Series", "features", "forecast", "load_series", "run"]


@dataclass(frozen=True)
class Series:
    """One real series and how it is split: the last ``horizon`` values are the test set."""

    name: str
    values: np.ndarray  # (T,) with NaN where nothing was observed
    labels: list[str]  # a date or year per value
    period: int  # m, the seasonal period (52 weeks; the ~11-year solar cycle)
    horizon: int  # values forecast at once, and the size of the held-out tail
    context: int  # W, the values the model and the linear baseline read

    @property
    def train_end(self) -> int:
        return len(self.values) - self.horizon


def load_series(name: str) -> Series:
    """``co2`` (weekly, 1958-2001, 59 missing weeks) or ``sunspots`` (yearly, 1700-2008)."""
    datasets = need("statsmodels.datasets", "multihead train forecast").__dict__
    if name == "co2":
        frame = datasets["co2"].load_pandas().data
        labels = [str(d.date()) for d in frame.index]
        return Series("co2", frame["co2"].to_numpy(float), labels, 52, 104, 208)
    if name == "sunspots":
        frame = datasets["sunspots"].load_pandas().data
        labels = [str(int(y)) for y in frame["YEAR"]]
        return Series("sunspots", frame["SUNACTIVITY"].to_numpy(float), labels, 11, 22, 66)
    raise ValueError(f"series must be one of {', '.join(SERIES)}. Received: series={name!r}")


SERIES = ("co2", "sunspots")


def interpolate(values: np.ndarray) -> np.ndarray:
    """Fill missing values linearly between the nearest observed neighbours."""
    observed = ~np.isnan(values)
    index = np.arange(len(values))
    return np.interp(index, index[observed], values[observed])


@register
class CausalForecaster(nn.Module):
    """Decoder-style forecaster: (B, L, F) features -> (B, L, horizon) predicted changes.

    Position t attends to positions <= t only (``masks.causal()``) and predicts
    ``(x[t + 1 : t + 1 + horizon] - x[t]) / scale``.

    Args:
        horizon: values predicted per position.
        in_features: F, features per time step (see ``features``).
        embed_dim: E.
        num_heads: H.
        num_layers: encoder layers (pre-norm, with a final LayerNorm).
        ff_dim: feed-forward width.
        dropout: dropout in every layer, in [0, 1).
        ar_lags: when > 0, a linear autoregressive term is added to every position's
            prediction: a linear map of the last ``ar_lags`` levels (relative to the current
            one; the first value repeated before the window starts), so the attention layers
            learn what a linear model misses. Causal like the rest.
    """

    def __init__(
        self,
        horizon: int,
        *,
        in_features: int = 2,
        embed_dim: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        ff_dim: int = 128,
        dropout: float = 0.0,
        ar_lags: int = 0,
    ) -> None:
        super().__init__()
        self.horizon, self.ar_lags = horizon, ar_lags
        self.embed = nn.Linear(in_features, embed_dim)
        self.position = SinusoidalPositionalEncoding(embed_dim)
        self.encoder = TransformerEncoder(
            [
                TransformerEncoderLayer(
                    embed_dim, num_heads, ff_dim, dropout=dropout, norm_first=True
                )
                for _ in range(num_layers)
            ],
            norm=nn.LayerNorm(embed_dim),
        )
        self.head = nn.Linear(embed_dim, horizon)
        self.ar = nn.Linear(ar_lags, horizon) if ar_lags > 0 else None

    def forward(
        self, x: Tensor, *, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """x: (B, L, F). Returns (B, L, horizon), with every layer's weights (B, H, L, L)."""
        h = self.position(self.embed(x))
        out = self.encoder(h, mask=masks.causal(), return_weights=return_weights)
        hidden, weights = (out.output, out.weights) if return_weights else (out, None)
        pred = self.head(hidden)
        if self.ar is not None:
            level = x[..., 0]  # [B, L]: differences of it are changes / scale
            padded = nn.functional.pad(level[:, None], (self.ar_lags, 0), mode="replicate")[:, 0]
            window = padded.unfold(1, self.ar_lags + 1, 1)  # [B, L, lags + 1]: t - lags .. t
            pred = pred + self.ar(window[..., :-1] - window[..., -1:])
        return (pred, weights) if return_weights else pred


def features(window: Tensor, scale: float, diff_scale: float) -> Tensor:
    """(B, W) values -> (B, W, 2): the level relative to the window's first value, and the step
    change from the previous value (0 at the first). Only the past enters each position."""
    level = (window - window[:, :1]) / scale
    step = torch.diff(window, dim=1, prepend=window[:, :1]) / diff_scale
    return torch.stack([level, step], dim=-1)


@dataclass(frozen=True)
class _Scales:
    level: float
    step: float


def _scales(train: np.ndarray) -> _Scales:
    return _Scales(float(np.std(train)), float(np.std(np.diff(train))))


def forecast(model: CausalForecaster, history: np.ndarray, scales: dict[str, float]) -> np.ndarray:
    """The next ``horizon`` values after ``history`` (the last W values are read)."""
    window = torch.as_tensor(history, dtype=torch.float32)[None]
    param = next(model.parameters())
    with torch.no_grad():
        x = features(window, scales["level"], scales["step"]).to(param.device)
        delta = model(x)[0, -1].float().cpu().numpy()
    return history[-1] + delta * scales["level"]


def seasonal_naive(train: np.ndarray, period: int, horizon: int) -> np.ndarray:
    """Repeat the last observed season."""
    last = train[-period:]
    return np.array([last[h % period] for h in range(horizon)])


def linear_direct(train: np.ndarray, context: int, horizon: int, ridge: float = 1e-3) -> np.ndarray:
    """Least squares from the last ``context`` values (minus the last one) to the next
    ``horizon`` changes, fitted on every training window, then applied at the origin."""
    rows = len(train) - context - horizon + 1
    view = np.lib.stride_tricks.sliding_window_view(train, context + horizon)[:rows]
    last = view[:, context - 1 : context]
    x = np.hstack([view[:, :context] - last, np.ones((rows, 1))])
    y = view[:, context:] - last
    penalty = ridge * np.eye(x.shape[1])
    penalty[-1, -1] = 0.0  # no penalty on the intercept
    coef = np.linalg.solve(x.T @ x + penalty * rows, x.T @ y)
    origin = np.append(train[-context:] - train[-1], 1.0)
    return train[-1] + origin @ coef


def autoreg(train: np.ndarray, lags: int, horizon: int) -> np.ndarray:
    """statsmodels AutoReg(lags, constant + trend), forecast recursively over the horizon."""
    ar = need("statsmodels.tsa.ar_model", "the AutoReg baseline")
    fitted = ar.AutoReg(train, lags=lags, trend="ct").fit()
    return np.asarray(fitted.predict(start=len(train), end=len(train) + horizon - 1))


def scores(pred: np.ndarray, truth: np.ndarray, observed: np.ndarray, scale: float) -> dict:
    """MAE and MASE over the observed test values."""
    mae = float(np.mean(np.abs(pred[observed] - truth[observed])))
    return {"mae": mae, "mase": mae / scale}


def _train_one(
    series: Series, options: Options, info: Dist
) -> tuple[CausalForecaster, FitResult, dict[str, float], np.ndarray]:
    filled = interpolate(series.values)
    train = filled[: series.train_end]
    s = _scales(train)
    context, horizon, period = series.context, series.horizon, series.period
    if options.quick:
        model = CausalForecaster(
            horizon, embed_dim=16, num_heads=2, num_layers=1, ff_dim=32, ar_lags=2 * period
        )
        config = options.train_config(epochs=1, batch_size=16, lr=3e-3)
    else:
        model = CausalForecaster(horizon, ar_lags=2 * period)
        epochs = 20 if series.name == "co2" else 150
        config = options.train_config(epochs=epochs, batch_size=32, lr=1e-3)
    if options.quick and config.max_steps is None:
        config.max_steps = 6
    values = torch.as_tensor(train, dtype=torch.float32)
    starts = len(train) - context - horizon + 1  # windows whose every target is in train
    ahead = values.unfold(0, horizon, 1)  # [T - horizon + 1, horizon] (a view)
    first = period  # positions with at least one season of context carry a loss
    offsets = torch.arange(first, context)

    def collate(idx: Tensor) -> tuple[Tensor, Tensor]:
        windows = values[idx[:, None] + torch.arange(context)]  # [n, W]
        target_pos = idx[:, None] + offsets + 1  # [n, W - first]
        delta = (ahead[target_pos] - windows[:, first:, None]) / s.level  # [n, W - first, H]
        x = features(windows, s.level, s.step)
        return x.to(info.device), delta.to(info.device)

    def loss_fn(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, target = batch
        pred = m(x)[:, first:]
        return (pred.float() - target).pow(2).mean(dim=(1, 2))

    result = fit(model, starts, collate, loss_fn, config, info, desc=series.name)
    return model, result, {"level": s.level, "step": s.step}, train


def _split_info(series: Series) -> dict[str, Any]:
    missing = np.isnan(series.values)
    end = series.train_end
    return {
        "length": len(series.values),
        "train_index": [0, end],
        "test_index": [end, len(series.values)],
        "test_first": series.labels[end],
        "test_last": series.labels[-1],
        "missing": {
            "total": int(missing.sum()),
            "in_test": int(missing[end:].sum()),
            "handling": "linear interpolation between observed neighbours before training and "
            "for the baselines' inputs; test errors count observed values only",
        },
        "period": series.period,
        "horizon": series.horizon,
        "context": series.context,
        "mase_scale": "mean |x[t] - x[t - period]| over the interpolated training part",
    }


def run(options: Options, info: Dist) -> dict[str, Any]:
    """Train one forecaster per series, compare with the baselines, write DIR (see module)."""
    started = time.perf_counter()
    if options.data is not None:
        raise ValueError(
            "forecast reads its series from statsmodels (co2, sunspots); --data is for the "
            f"sentiment task. Received: --data {options.data}"
        )
    seed_everything(options.seed)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    curves: dict[str, FitResult] = {}
    plots: dict[str, dict[str, np.ndarray]] = {}
    weights: dict[str, Tensor] = {}
    for name in SERIES:
        series = load_series(name)
        model, fitted, scales, train = _train_one(series, options, info)
        curves[name] = fitted
        if not info.main:
            continue
        model.eval()
        truth = series.values[series.train_end :]
        observed = ~np.isnan(truth)
        period = series.period
        mase_scale = float(np.mean(np.abs(train[period:] - train[:-period])))
        pred = forecast(model, train[-series.context :], scales)
        preds = {"model": pred}
        if options.baselines:
            preds["seasonal_naive"] = seasonal_naive(train, period, series.horizon)
            preds["linear_direct"] = linear_direct(train, series.context, series.horizon)
            preds["autoreg"] = autoreg(train, 2 * period, series.horizon)
        folder = out / ("model" if name == "co2" else f"model-{name}")
        save(model, folder)
        with torch.no_grad():
            x = features(torch.as_tensor(train[-series.context :], dtype=torch.float32)[None],
                         scales["level"], scales["step"])  # fmt: skip
            weights[name] = (
                model(x.to(next(model.parameters()).device), return_weights=True)[1][-1][0]
                .float()
                .cpu()
            )
        results[name] = {
            "split": _split_info(series),
            "scales": scales,
            "model_dir": folder.name,
            "metrics": {k: scores(v, truth, observed, mase_scale) for k, v in preds.items()},
            "forecast": [float(v) for v in pred],
            "training": fitted.summary(),
        }
        plots[name] = {"history": train, "truth": truth, **preds}
    if info.main:
        _forecast_figure(plots, [load_series(n) for n in SERIES], out / "forecast.png")
        training_curve(curves, out / "training_curve.png", "causal forecaster, MSE on changes")
        _attention_figure(weights, out / "attention.png")
        model_metrics = results["co2"]["metrics"]
        goal = None
        if options.baselines:
            goal = all(
                model_metrics["model"]["mae"] < model_metrics[b]["mae"]
                for b in ("seasonal_naive", "linear_direct")
            )
        summary = {
            "task": "forecast",
            "series": results,
            "goal_beats_seasonal_naive_and_linear_on_co2": goal,
            "figures": ["training_curve.png", "forecast.png", "attention.png"],
        }
        return finish(summary, options, info, started)
    return {}


def _forecast_figure(plots: dict, series: list[Series], path: Path) -> Path:
    fig = figure(figsize=(11, 3.6 * len(plots)))
    axes = fig.subplots(len(plots), 1, squeeze=False)[:, 0]
    styles = {
        "model": ("tab:red", "-"),
        "seasonal_naive": ("tab:green", ":"),
        "linear_direct": ("tab:purple", "--"),
        "autoreg": ("tab:orange", "-."),
    }
    for ax, s in zip(axes, series):
        p = plots[s.name]
        end = s.train_end
        shown = min(end, 4 * s.horizon)
        x_hist = np.arange(end - shown, end)
        x_test = np.arange(end, len(s.values))
        ax.plot(x_hist, p["history"][-shown:], color="black", lw=1, label="history")
        ax.plot(x_test, p["truth"], color="tab:blue", lw=1.5, label="truth (held out)")
        for key, (color, style) in styles.items():
            if key in p:
                ax.plot(x_test, p[key], color=color, ls=style, lw=1.3, label=key)
        ticks = np.linspace(end - shown, len(s.values) - 1, 6).astype(int)
        ax.set_xticks(ticks, [s.labels[i] for i in ticks], fontsize=8)
        ax.axvline(end - 0.5, color="gray", lw=0.8)
        ax.set_title(f"{s.name}: forecast of the last {s.horizon} values", fontsize=10)
        ax.legend(fontsize=7, ncol=3)
    return save_figure(fig, path)


def _attention_figure(weights: dict[str, Tensor], path: Path) -> Path:
    """Last layer: how much the forecasting (last) position puts on each earlier step, per head."""
    fig = figure(figsize=(11, 3.2 * len(weights)))
    axes = fig.subplots(len(weights), 1, squeeze=False)[:, 0]
    for ax, (name, w) in zip(axes, weights.items()):
        last = w[:, -1]  # [H, L]
        lags = np.arange(last.shape[-1] - 1, -1, -1)
        for h in range(last.shape[0]):
            ax.plot(lags, last[h].numpy(), lw=1, label=f"head {h}")
        ax.invert_xaxis()
        ax.set_xlabel("steps before the forecast origin")
        ax.set_ylabel("attention weight")
        ax.set_title(f"{name}: last layer, weights of the forecasting position", fontsize=10)
        ax.legend(fontsize=7, ncol=4)
    return save_figure(fig, path)
