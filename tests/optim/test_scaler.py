"""The dynamic loss scaler: back off on overflow, grow after a window, floor, state."""

from __future__ import annotations

import pytest

from colonnade.optim.scaler import ConstantLossScaler, DynamicLossScaler


def test_backoff_growth_and_floor() -> None:
    s = DynamicLossScaler(scale=8.0, window=3, min_scale=2.0)
    s.update(True)
    assert s.scale == 4.0 and s.clean_steps == 0
    s.update(True)
    s.update(True)
    assert s.scale == 2.0, "never below min_scale"
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0 and s.clean_steps == 2
    s.update(False)
    assert s.scale == 4.0 and s.clean_steps == 0, "doubles after `window` clean steps"
    s.update(False)
    s.update(True)
    assert s.scale == 2.0 and s.clean_steps == 0, "an overflow restarts the count"


def test_state_dict_round_trip() -> None:
    s = DynamicLossScaler(scale=1024.0, window=5)
    s.update(False)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps) == (512.0, 1)
    c = ConstantLossScaler()
    c.update(True)
    assert c.scale == 1.0


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="loss_scale_window"):
        DynamicLossScaler(window=0)
    with pytest.raises(ValueError, match="initial_loss_scale"):
        DynamicLossScaler(scale=0.0)
