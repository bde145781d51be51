"""The engine against the bytes model (``faultfs.testing.model``), and the model against
deliberately broken engines: each must be caught, or the model proves nothing."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from faultfs.testing.model import EngineModel, EngineModelAttached, EngineModelCapped, mutant

SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None,
    derandomize=bool(os.environ.get("CI")),  # CI replays the same examples; local runs explore
    suppress_health_check=[HealthCheck.too_slow])

test_engine_matches_the_bytes_model = EngineModel.TestCase
test_engine_matches_the_bytes_model.settings = SETTINGS
test_attached_engine_matches_the_bytes_model = EngineModelAttached.TestCase
test_attached_engine_matches_the_bytes_model.settings = SETTINGS
test_capped_engine_matches_the_bytes_model = EngineModelCapped.TestCase
test_capped_engine_matches_the_bytes_model.settings = SETTINGS


@pytest.mark.parametrize("kind", ["eio", "zeros", "unverified"])
def test_the_model_catches_a_broken_engine(kind):
    hunt = settings(SETTINGS, max_examples=200, derandomize=True,
                    phases=[Phase.explicit, Phase.generate])  # found is enough: no shrinking
    with mutant(kind), pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(EngineModel, settings=hunt)
