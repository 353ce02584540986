"""``multihead train forecast``: a causal-attention forecaster on two real series shipped inside
statsmodels, the weekly Mauna Loa CO2 record and yearly sunspot numbers.

The tail of each series (one horizon) is held out. The model reads a window, one token per time
step, under ``masks.causal()``; every position predicts the next ``horizon`` values, so one
window trains several positions at once and position t never sees a value after t. The
forecast is the last position's prediction. The prediction is a correction on top of a strong
linear part: the direct least-squares forecast (the linear baseline's own coefficients, fitted
on the training series and frozen) plus an attention head that starts at exactly zero and
learns the residual; the epoch kept (0: the linear part alone) is the one with the lowest MAE
on a validation tail carved from the training series, never the test tail.

Baselines on the same split: the seasonal-naive forecast (repeat the last season), the direct
linear model on the same context (the lesson of Zeng et al. 2023, "Are Transformers Effective
for Time Series Forecasting?") and statsmodels' ``AutoReg``. Metrics: MAE and MASE (MAE over
the training set's in-sample seasonal-naive MAE, Hyndman & Koehler 2006).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .. import masks
from ..io import register, save
from ..modules import (
    SinusoidalPositionalEncoding,
    StackOutput,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from .common import Options, figure, finish, need, save_figure, seed_everything, training_curve
from .loop import Dist, FitResult, fit

__all__ = [
    "SERIES",
    "SUMMARY",
    "CausalForecaster",
    "Series",
    "features",
    "fit_linear",
    "forecast",
    "linear_direct",
    "load_series",
    "run",
    "throughput",
]

SUMMARY = "a causal-attention forecaster of CO2 and sunspots, beside seasonal-naive and linear"


@dataclass(frozen=True)
class Series:
    """One real series and how it is split: the last ``horizon`` values are the test set."""

    name: str
    values: np.ndarray  # (T,) with NaN where nothing was observed
    labels: list[str]  # a date or year per value
    period: int  # m, the seasonal period (52 weeks; the ~11-year solar cycle)
    horizon: int  # values forecast at once, and the size of the held-out tail
    context: int  # W, the values the linear baseline and the model's linear part read

    @property
    def train_end(self) -> int:
        return len(self.values) - self.horizon

    @property
    def window(self) -> int:
        """The values the model reads: W plus one period, so that the last ``period + 1``
        positions have the linear part's whole context and carry the training loss."""
        return self.context + self.period

    @property
    def validation_start(self) -> int:
        """The validation tail is the training series' last ``2 * horizon`` values."""
        return self.train_end - VALIDATION_HORIZONS * self.horizon


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
VALIDATION_HORIZONS = 2  # the validation tail, in horizons: H + 1 forecast origins fit in it


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

    With ``linear_lags`` = W > 0 the prediction is ``linear(t) + head(attention(t))``: a frozen
    direct linear forecast from the last W levels (relative to the current one), whose
    coefficients ``set_linear`` installs (``fit_linear`` computes them by least squares), plus
    an attention head initialized to exactly zero, so the untrained model *is* the linear
    model and training learns only what it misses. Positions t < W - 1 see the first level
    repeated before the window starts; the training loss skips them.

    Args:
        horizon: values predicted per position.
        in_features: F, features per time step (see ``features``).
        embed_dim: E.
        num_heads: H.
        num_layers: encoder layers (pre-norm, with a final LayerNorm).
        ff_dim: feed-forward width.
        dropout: dropout in every layer, in [0, 1).
        linear_lags: W of the frozen linear part (0: attention alone).
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
        linear_lags: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(linear_lags, bool) or not isinstance(linear_lags, int) or linear_lags < 0:
            raise ValueError(
                f"linear_lags must be an int >= 0 (0: no linear part). "
                f"Received: linear_lags={linear_lags!r}"
            )
        self.horizon, self.linear_lags = horizon, linear_lags
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
        if linear_lags:
            # buffers, not parameters: the optimizer never moves the least-squares fit
            self.register_buffer("linear_weight", torch.zeros(horizon, linear_lags))
            self.register_buffer("linear_bias", torch.zeros(horizon))
            nn.init.zeros_(self.head.weight)  # the correction starts at exactly 0
            nn.init.zeros_(self.head.bias)

    def set_linear(self, weight: Tensor, bias: Tensor) -> None:
        """Install the linear part: weight (horizon, W) on ``level[t - W + 1 .. t] - level[t]``,
        bias (horizon,), both in the model's scaled units."""
        if not self.linear_lags:
            raise ValueError("this model has no linear part. Received: linear_lags=0")
        shape = (self.horizon, self.linear_lags)
        if tuple(weight.shape) != shape or tuple(bias.shape) != (self.horizon,):
            raise ValueError(
                f"the linear part needs weight {shape} and bias ({self.horizon},). Received: "
                f"weight {tuple(weight.shape)}, bias {tuple(bias.shape)}"
            )
        with torch.no_grad():
            self.linear_weight.copy_(weight)
            self.linear_bias.copy_(bias)

    def linear(self, level: Tensor) -> Tensor:
        """level (B, L) -> the linear part's prediction (B, L, horizon) at every position."""
        lags = self.linear_lags
        padded = nn.functional.pad(level[:, None], (lags - 1, 0), mode="replicate")[:, 0]
        window = padded.unfold(1, lags, 1)  # [B, L, W]: levels t - W + 1 .. t
        relative = window - level[..., None]
        weight, bias = self.linear_weight.to(level.dtype), self.linear_bias.to(level.dtype)
        return relative @ weight.T + bias

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, L, F). Returns (B, L, horizon); ``run`` also returns the weights."""
        return self._predict(x, self.encoder(self.position(self.embed(x)), mask=masks.causal()))

    def run(self, x: Tensor) -> StackOutput:
        """``forward`` with every layer's weights (B, H, L, L): ``StackOutput(output
        (B, L, horizon), None, weights)``."""
        out = self.encoder.run(self.position(self.embed(x)), mask=masks.causal())
        return StackOutput(self._predict(x, out.output), None, out.weights)

    def _predict(self, x: Tensor, hidden: Tensor) -> Tensor:
        pred = self.head(hidden)
        if self.linear_lags:
            level = x[..., 0]
            # in float32 at least, outside autocast: bf16 would round the linear forecast
            with torch.autocast(x.device.type, enabled=False):
                linear = self.linear(level.to(torch.promote_types(level.dtype, torch.float32)))
            pred = pred.to(linear.dtype) + linear
        return pred


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
    """The next ``horizon`` values after ``history`` (T,), or after each row of (N, T)
    histories ((N, horizon) then); the model reads all of each row (pass its window)."""
    rows = np.atleast_2d(np.asarray(history, dtype=float))
    window = torch.as_tensor(rows, dtype=torch.float32)
    param = next(model.parameters())
    with torch.no_grad():
        x = features(window, scales["level"], scales["step"]).to(param.device)
        delta = model(x)[:, -1].double().cpu().numpy()  # [N, horizon]
    out = rows[:, -1:] + delta * scales["level"]
    return out if np.ndim(history) == 2 else out[0]


def seasonal_naive(train: np.ndarray, period: int, horizon: int) -> np.ndarray:
    """Repeat the last observed season."""
    last = train[-period:]
    return np.array([last[h % period] for h in range(horizon)])


def fit_linear(train: np.ndarray, context: int, horizon: int, ridge: float = 1e-3) -> np.ndarray:
    """Least squares from the last ``context`` values (minus the last one) to the next
    ``horizon`` changes over every training window, the intercept unpenalized.

    Returns coef (context + 1, horizon): rows for the ``context`` relative values, then the
    intercept.
    """
    rows = len(train) - context - horizon + 1
    view = np.lib.stride_tricks.sliding_window_view(train, context + horizon)[:rows]
    last = view[:, context - 1 : context]
    x = np.hstack([view[:, :context] - last, np.ones((rows, 1))])
    y = view[:, context:] - last
    penalty = ridge * np.eye(x.shape[1])
    penalty[-1, -1] = 0.0  # no penalty on the intercept
    return np.linalg.solve(x.T @ x + penalty * rows, x.T @ y)


def linear_direct(train: np.ndarray, context: int, horizon: int, ridge: float = 1e-3) -> np.ndarray:
    """The direct linear forecast (``fit_linear``) applied at the end of ``train``."""
    coef = fit_linear(train, context, horizon, ridge)
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


def _validation_mae(
    model: CausalForecaster, series: Series, filled: np.ndarray, scales: dict[str, float]
) -> float:
    """MAE of the forecasts from every origin whose whole horizon lies in the validation tail
    (observed values only), the way the test tail is scored."""
    window, horizon = series.window, series.horizon
    origins = np.arange(series.validation_start - 1, series.train_end - horizon)
    histories = np.stack([filled[o - window + 1 : o + 1] for o in origins])
    truth = np.stack([series.values[o + 1 : o + 1 + horizon] for o in origins])
    was_training = model.training
    model.eval()
    pred = forecast(model, histories, scales)
    model.train(was_training)
    observed = ~np.isnan(truth)
    return float(np.mean(np.abs(pred - truth)[observed]))


def _train_one(
    series: Series, options: Options, info: Dist
) -> tuple[CausalForecaster, FitResult, dict[str, float], np.ndarray, dict[str, Any]]:
    """Fit the linear part on the training series, train the attention correction on windows
    whose targets end before the validation tail, keep the epoch (0 = none) with the lowest
    validation MAE."""
    filled = interpolate(series.values)
    train = filled[: series.train_end]
    s = _scales(train)
    scales = {"level": s.level, "step": s.step}
    context, horizon, window = series.context, series.horizon, series.window
    if options.quick:
        model = CausalForecaster(
            horizon, embed_dim=16, num_heads=2, num_layers=1, ff_dim=32, linear_lags=context
        )
        config = options.train_config(epochs=1, batch_size=16, lr=3e-3)
    else:
        model = CausalForecaster(horizon, linear_lags=context)
        epochs = 20 if series.name == "co2" else 150
        config = options.train_config(epochs=epochs, batch_size=32, lr=1e-3)
    if options.quick and config.max_steps is None:
        config.max_steps = 6
    # the linear baseline's own coefficients: the untrained model forecasts exactly as it does
    coef = fit_linear(train, context, horizon)
    model.set_linear(
        torch.as_tensor(coef[:-1].T, dtype=torch.float32),
        torch.as_tensor(coef[-1] / s.level, dtype=torch.float32),
    )
    values = torch.as_tensor(train, dtype=torch.float32)
    # windows whose every target lies before the validation tail
    starts = series.validation_start - window - horizon + 1
    ahead = values.unfold(0, horizon, 1)  # [T - horizon + 1, horizon] (a view)
    first = context - 1  # positions with the linear part's whole context carry a loss
    offsets = torch.arange(first, window)

    def collate(idx: Tensor) -> tuple[Tensor, Tensor]:
        windows = values[idx[:, None] + torch.arange(window)]  # [n, L]
        target_pos = idx[:, None] + offsets + 1  # [n, L - first]
        delta = (ahead[target_pos] - windows[:, first:, None]) / s.level  # [n, L - first, H]
        x = features(windows, s.level, s.step)
        return x.to(info.device), delta.to(info.device)

    def loss_fn(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, target = batch
        pred = m(x)[:, first:]
        return (pred.float() - target).pow(2).mean(dim=(1, 2))

    # every process evaluates the same parameters, so all keep the same epoch
    curve = [_validation_mae(model, series, filled, scales)]
    best = (curve[0], 0, copy.deepcopy(model.state_dict()))

    def after_epoch(epoch: int) -> None:
        nonlocal best
        curve.append(_validation_mae(model, series, filled, scales))
        if curve[-1] < best[0]:
            best = (curve[-1], epoch, copy.deepcopy(model.state_dict()))

    result = fit(model, starts, collate, loss_fn, config, info, desc=series.name,
                 after_epoch=after_epoch)  # fmt: skip
    options.adopt(result)
    model.load_state_dict(best[2])
    selection = {
        "validation_index": [series.validation_start, series.train_end],
        "validation_first": series.labels[series.validation_start],
        "validation_origins": series.horizon + 1,
        "train_windows": starts,
        "validation_mae_by_epoch": curve,  # entry 0: the linear part alone
        "epoch_kept": best[1],
    }
    return model, result, scales, train, selection


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
        "model_window": series.window,
        "validation_index": [series.validation_start, end],
        "mase_scale": "mean |x[t] - x[t - period]| over the interpolated training part",
    }


def run(options: Options, info: Dist, out: Path | None) -> dict[str, Any]:
    """Train one forecaster per series, compare with the baselines, write the run into
    ``out`` (None on processes other than rank 0, which write nothing; see module)."""
    started = time.perf_counter()
    if options.data is not None:
        raise ValueError(
            "forecast reads its series from statsmodels (co2, sunspots); --data is for the "
            f"sentiment task. Received: --data {options.data}"
        )
    seed_everything(options.seed)
    results: dict[str, Any] = {}
    curves: dict[str, FitResult] = {}
    plots: dict[str, dict[str, np.ndarray]] = {}
    weights: dict[str, Tensor] = {}
    for name in SERIES:
        series = load_series(name)
        model, fitted, scales, train, selection = _train_one(series, options, info)
        curves[name] = fitted
        if out is None:
            continue
        model.eval()
        truth = series.values[series.train_end :]
        observed = ~np.isnan(truth)
        period = series.period
        mase_scale = float(np.mean(np.abs(train[period:] - train[:-period])))
        pred = forecast(model, train[-series.window :], scales)
        preds = {"model": pred}
        if options.baselines:
            preds["seasonal_naive"] = seasonal_naive(train, period, series.horizon)
            preds["linear_direct"] = linear_direct(train, series.context, series.horizon)
            preds["autoreg"] = autoreg(train, 2 * period, series.horizon)
        folder = out / ("model" if name == "co2" else f"model-{name}")
        save(model, folder)
        with torch.no_grad():
            x = features(torch.as_tensor(train[-series.window :], dtype=torch.float32)[None],
                         scales["level"], scales["step"])  # fmt: skip
            weights[name] = (
                model.run(x.to(next(model.parameters()).device)).weights[-1][0].float().cpu()
            )
        results[name] = {
            "split": _split_info(series),
            "scales": scales,
            "model_dir": folder.name,
            "metrics": {k: scores(v, truth, observed, mase_scale) for k, v in preds.items()},
            "forecast": [float(v) for v in pred],
            "selection": selection,
            "training": fitted.summary(),
        }
        plots[name] = {"history": train, "truth": truth, **preds}
    if out is not None:
        _forecast_figure(plots, [load_series(n) for n in SERIES], out / "forecast.png")
        training_curve(curves, out / "training_curve.png", "causal forecaster, MSE on changes")
        _attention_figure(weights, out / "attention.png")
        model_metrics = results["co2"]["metrics"]
        goal = None
        if options.baselines:
            goal = all(
                model_metrics["model"]["mae"] < model_metrics[b]["mae"]
                for b in ("seasonal_naive", "linear_direct", "autoreg")
            )
        summary = {
            "task": "forecast",
            "model": "frozen direct least-squares forecast + zero-initialized causal-attention "
            "correction; epoch kept by the MAE on the training series' last 2 horizons",
            "series": results,
            "goal_beats_naive_linear_and_autoreg_on_co2": goal,
            "figures": ["training_curve.png", "forecast.png", "attention.png"],
        }
        return finish(summary, options, info, started, out)
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


def throughput(options: Options, info: Dist, steps: int) -> dict[str, Any]:
    """The training step alone, for ``multihead bench train``: the CO2 forecaster's training
    (``options.max_steps`` bounds it); its ``FitResult`` summary."""
    return _train_one(load_series("co2"), options, info)[1].summary()
