"""The serving state both front ends read: loading -> ready -> draining, and what a request gets in each."""

from __future__ import annotations

from typing import cast

import pytest

from serve.api.common import LoadedModel
from serve.api.state import ServingState
from serve.errors import Draining

# ServingState only holds the model; any object stands in for one.
MODEL = cast(LoadedModel, object())


def test_a_loading_server_refuses_requests_until_its_model_is_loaded() -> None:
    state = ServingState()
    assert state.model is None and not state.draining
    with pytest.raises(Draining, match="still loading"):
        state.ready_model()
    state.loaded(MODEL)
    assert state.ready_model() is MODEL


def test_a_draining_server_refuses_requests_and_keeps_its_model() -> None:
    state = ServingState()
    state.loaded(MODEL)
    state.start_draining()
    assert state.draining and state.model is MODEL  # the drain still needs its scheduler
    with pytest.raises(Draining, match="shutting down"):
        state.ready_model()


def test_a_server_that_drains_while_loading_says_it_is_shutting_down() -> None:
    state = ServingState()
    state.start_draining()
    with pytest.raises(Draining, match="shutting down"):
        state.ready_model()
