import pytest

from specdistill.config import ConfigError, DemoConfig
from specdistill.demo import training_minutes


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
