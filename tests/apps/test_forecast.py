"""multihead train forecast: split and baselines recomputed independently (numpy formulas,
scikit-learn's Ridge, statsmodels' data), the causal mask, and the saved model's forecast."""

from __future__ import annotations

import json

import numpy as np
import pytest
import statsmodels.api as sm
import torch
from helpers import assert_run_summary, train_quick
from sklearn.linear_model import Ridge

import multihead as mh
from multihead.apps import forecast
from multihead.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The quick run's folder and what it printed."""
    return train_quick("forecast", tmp_path_factory)


@pytest.fixture(scope="module")
def run_dir(trained):
    return trained[0]


def test_the_run_ends_with_its_metrics_table_and_folder(trained):
    assert_run_summary(trained)


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
    assert split["validation_index"] == [1972, 2180] and split["model_window"] == 260
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


def _ridge_forecasts(series: np.ndarray, origins: np.ndarray, context: int, horizon: int):
    """The direct linear forecast from each origin, by scikit-learn's Ridge fitted on every
    window of ``series`` (the same normal equations as ``linear_direct``)."""
    windows = np.lib.stride_tricks.sliding_window_view(series, context + horizon)
    last = windows[:, context - 1 : context]
    ridge = Ridge(alpha=1e-3 * len(windows)).fit(
        windows[:, :context] - last, windows[:, context:] - last
    )
    inputs = np.stack([series[o - context + 1 : o + 1] - series[o] for o in origins])
    return series[origins][:, None] + ridge.predict(inputs)


def test_untrained_correction_is_the_linear_model():
    """With its head at zero (as built) the forecaster forecasts what the direct linear model
    does, recomputed with scikit-learn; float32 features of values near 370 ppm round at
    ~3e-5 ppm, so 1e-4 ppm."""
    series = forecast.load_series("co2")
    train = forecast.interpolate(series.values)[: series.train_end]
    scales = forecast._scales(train)
    coef = forecast.fit_linear(train, 208, 104)
    torch.manual_seed(0)
    model = forecast.CausalForecaster(104, embed_dim=16, num_heads=2, num_layers=1,
                                      linear_lags=208)  # fmt: skip
    assert not model.head.weight.any() and not model.head.bias.any()
    model.set_linear(torch.tensor(coef[:-1].T, dtype=torch.float32),
                     torch.tensor(coef[-1] / scales.level, dtype=torch.float32))  # fmt: skip
    origins = np.array([1971, 2000, 2179])
    histories = np.stack([train[o - 259 : o + 1] for o in origins])
    ours = forecast.forecast(model.eval(), histories, {"level": scales.level, "step": scales.step})
    expected = _ridge_forecasts(train, origins, 208, 104)
    assert np.abs(ours - expected).max() < 1e-4
    assert np.abs(ours[-1] - forecast.linear_direct(train, 208, 104)).max() < 1e-4


def test_epoch_kept_by_the_validation_tail(run_dir):
    """Entry 0 of the validation curve is the linear model alone, recomputed with Ridge on the
    training series' last 2 horizons (observed weeks only); the saved model is the epoch with
    the lowest validation MAE, and its own validation MAE is that entry."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    selection = metrics["series"]["co2"]["selection"]
    curve = selection["validation_mae_by_epoch"]
    assert selection["validation_index"] == [1972, 2180] and selection["validation_origins"] == 105
    raw = _co2()
    train = forecast.interpolate(raw)[:2180]
    origins = np.arange(1971, 2076)
    truth = np.stack([raw[o + 1 : o + 105] for o in origins])
    linear = _ridge_forecasts(train, origins, 208, 104)
    # float32 features (1e-4 ppm, as above) averaged over 10,920 errors
    assert curve[0] == pytest.approx(np.nanmean(np.abs(linear - truth)), abs=1e-4)
    assert len(curve) == 2 and selection["epoch_kept"] == int(np.argmin(curve))
    model = mh.load(run_dir / "model")
    histories = np.stack([train[o - 259 : o + 1] for o in origins])
    again = forecast.forecast(model, histories, metrics["series"]["co2"]["scales"])
    assert np.nanmean(np.abs(again - truth)) == pytest.approx(min(curve), abs=1e-6)


def test_saved_model_loads_and_reproduces_the_forecast(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for name, folder in (("co2", "model"), ("sunspots", "model-sunspots")):
        entry = metrics["series"][name]
        model = mh.load(run_dir / folder)
        assert type(model) is forecast.CausalForecaster
        series = forecast.load_series(name)
        history = forecast.interpolate(series.values)[: series.train_end][-series.window :]
        again = forecast.forecast(model, history, entry["scales"])
        # fp32 model, values ~370 ppm: float32 rounding of the level is ~2e-5
        assert np.abs(again - np.array(entry["forecast"])).max() < 1e-4
        assert entry["metrics"]["model"]["mae"] == pytest.approx(
            np.nanmean(np.abs(again - series.values[series.train_end :])), rel=1e-5
        )


def test_forecaster_is_causal():
    """Changing the future never changes an earlier position's prediction, through the
    attention or the linear part; changing the past does (so the test can fail)."""
    torch.manual_seed(0)
    model = forecast.CausalForecaster(5, embed_dim=16, num_heads=2, num_layers=2, ff_dim=24,
                                      linear_lags=7).eval()  # fmt: skip
    model.set_linear(torch.randn(5, 7), torch.randn(5))
    torch.nn.init.normal_(model.head.weight)  # the correction is zero until trained
    x = torch.randn(2, 30, 2)
    later = x.clone()
    later[:, 20:] += torch.randn(2, 10, 2)
    with torch.no_grad():
        a, b = model(x), model(later)
        linear_a, linear_b = model.linear(x[..., 0]), model.linear(later[..., 0])
    assert torch.equal(a[:, :20], b[:, :20])
    assert torch.equal(linear_a[:, :20], linear_b[:, :20])
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3
    assert (linear_a[:, 20:] - linear_b[:, 20:]).abs().max() > 1e-3


def test_forecast_rejects_data_and_bad_series():
    assert main(["train", "forecast", "--out", "x", "--data", "file.csv"]) == 2
    with pytest.raises(
        ValueError, match=r"series must be one of co2, sunspots. Received: series='gdp'"
    ):
        forecast.load_series("gdp")
    with pytest.raises(ValueError, match=r"linear_lags must be an int >= 0.*Received: "):
        forecast.CausalForecaster(4, linear_lags=-1)
    model = forecast.CausalForecaster(4, embed_dim=8, num_heads=2, linear_lags=6)
    with pytest.raises(ValueError, match=r"needs weight \(4, 6\) and bias \(4,\). Received: "):
        model.set_linear(torch.zeros(6, 4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"no linear part. Received: linear_lags=0"):
        forecast.CausalForecaster(4, embed_dim=8).set_linear(torch.zeros(4, 6), torch.zeros(4))
