import pytest

from specdistill.config import ConfigError, DemoConfig
from specdistill.demo import generation_minutes, training_minutes


def test_demo_training_shrinks_to_fit_the_wall_clock_budget():
    cfg = DemoConfig(max_total_minutes=27, reserve_minutes=7, min_train_minutes=3)
    assert training_minutes(10, 8.0, cfg) == 10  # a normal day: the preset's 10 minutes fit
    assert training_minutes(10, 13.0, cfg) == pytest.approx(7.0)  # slow generation: 27 − 13 − 7
    assert training_minutes(10, 25.0, cfg) == 3  # never below the floor, even past the budget
    assert training_minutes(0, 8.0, cfg) == pytest.approx(12.0)  # no preset limit: all that is left
    assert training_minutes(10, 25.0, DemoConfig()) == 10  # budget off: the preset unchanged


def test_demo_budget_values_are_checked():
    with pytest.raises(ConfigError, match="max_total_minutes"):
        DemoConfig(max_total_minutes=-1)
    with pytest.raises(ConfigError, match="min_train_minutes"):
        DemoConfig(min_train_minutes=0)


def test_demo_generation_shrinks_first_when_setup_was_slow():
    cfg = DemoConfig(max_total_minutes=29, reserve_minutes=8, min_train_minutes=3)
    assert generation_minutes(8, 2.0, cfg) == 8  # a quick setup: the preset's 8 minutes
    assert generation_minutes(8, 14.0, cfg) == pytest.approx(4.0)  # 29 − 14 − 8 − 3 leaves 4 for data
    assert generation_minutes(8, 28.0, cfg) == 0.5  # past the budget: one batch's worth, never zero data
    assert generation_minutes(0, 2.0, cfg) == pytest.approx(16.0)  # no preset limit: what the budget allows
    assert generation_minutes(8, 20.0, DemoConfig()) == 8  # budget off: the preset unchanged
    with pytest.raises(ConfigError, match="started_at"):
        DemoConfig(started_at=-1)
