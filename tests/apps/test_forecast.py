"""multihead train forecast: split and baselines recomputed independently (numpy formulas,
scikit-learn's Ridge, statsmodels' data), the causal mask, and the saved model's forecast."""

from __future__ import annotations

import json

import numpy as np
import pytest
import statsmodels.api as sm
import torch
from sklearn.linear_model import Ridge

import multihead as mh
from multihead.apps import forecast
from multihead.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("forecast")
    assert main(["train", "forecast", "--quick", "--out", str(out), "--no-progress"]) == 0
    return out


def _co2():
    return sm.datasets.co2.load_pandas().data["co2"].to_numpy(float)


def test_metrics_state_the_split_and_recompute(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["seed"] == 0 and metrics["wall_seconds"] > 0
    co2 = metrics["series"]["co2"]
    split = co2["split"]
    assert split["test_index"] == [2180, 2284] and split["test_first"] == "2000-01-08"
    assert split["missing"]["total"] == 59  # statsmodels' co2 has 59 unobserved weeks
    # seasonal naive and MASE from the definitions, on the raw series with NaN filled by pandas
    values = _co2()
    filled = sm.datasets.co2.load_pandas().data["co2"].interpolate().to_numpy()
    train, test = filled[:2180], values[2180:]
    naive = np.tile(train[-52:], 2)
    scale = np.mean(np.abs(train[52:] - train[:-52]))
    mae = np.nanmean(np.abs(naive - test))
    got = co2["metrics"]["seasonal_naive"]
    assert got["mae"] == pytest.approx(mae, rel=1e-12)
    assert got["mase"] == pytest.approx(mae / scale, rel=1e-12)
    assert set(co2["metrics"]) == {"model", "seasonal_naive", "linear_direct", "autoreg"}
    sun = metrics["series"]["sunspots"]["split"]
    assert sun["test_first"] == "1987" and sun["test_last"] == "2008"
    for name in metrics["figures"]:
        png = (run_dir / name).read_bytes()
        assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_linear_baseline_matches_scikit_learn_ridge():
    """The direct linear model equals Ridge on (last W values - last value) -> next H changes,
    intercept unpenalized (both solve the same normal equations; 1e-6 ppm)."""
    series = forecast.interpolate(_co2())[:2180]
    context, horizon, alpha = 208, 104, 1e-3
    windows = np.lib.stride_tricks.sliding_window_view(series, context + horizon)
    last = windows[:, context - 1 : context]
    ridge = Ridge(alpha=alpha * len(windows)).fit(
        windows[:, :context] - last, windows[:, context:] - last
    )
    expected = series[-1] + ridge.predict((series[-context:] - series[-1])[None])[0]
    ours = forecast.linear_direct(series, context, horizon, ridge=alpha)
    assert np.abs(ours - expected).max() < 1e-6


def test_saved_model_loads_and_reproduces_the_forecast(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for name, folder in (("co2", "model"), ("sunspots", "model-sunspots")):
        entry = metrics["series"][name]
        model = mh.load(run_dir / folder)
        assert type(model) is forecast.CausalForecaster
        series = forecast.load_series(name)
        history = forecast.interpolate(series.values)[: series.train_end][-series.context :]
        again = forecast.forecast(model, history, entry["scales"])
        # fp32 model, values ~370 ppm: float32 rounding of the level is ~2e-5
        assert np.abs(again - np.array(entry["forecast"])).max() < 1e-4
        assert entry["metrics"]["model"]["mae"] == pytest.approx(
            np.nanmean(np.abs(again - series.values[series.train_end :])), rel=1e-5
        )


def test_forecaster_is_causal():
    """Changing the future never changes an earlier position's prediction; changing the past
    does (so the test can fail)."""
    torch.manual_seed(0)
    model = forecast.CausalForecaster(5, embed_dim=16, num_heads=2, num_layers=2, ff_dim=24).eval()
    x = torch.randn(2, 30, 2)
    later = x.clone()
    later[:, 20:] += torch.randn(2, 10, 2)
    with torch.no_grad():
        a, b = model(x), model(later)
    assert torch.equal(a[:, :20], b[:, :20])
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3


def test_forecast_rejects_data_and_bad_series():
    assert main(["train", "forecast", "--out", "x", "--data", "file.csv"]) == 2
    with pytest.raises(
        ValueError, match=r"series must be one of co2, sunspots. Received: series='gdp'"
    ):
        forecast.load_series("gdp")
