"""The serving state both front ends read and only the lifecycle (`serve.api.lifecycle`) changes: the loaded
model (none while it loads) and whether the server is draining."""

from __future__ import annotations

from serve.api.common import LoadedModel
from serve.errors import Draining


class ServingState:
    """Loading (no model yet) -> ready (`loaded`) -> draining (`start_draining`, also when the engine process
    dies). A draining server stays draining: the process then stops."""

    def __init__(self) -> None:
        self.model: LoadedModel | None = None
        self.draining = False

    def loaded(self, model: LoadedModel) -> None:
        self.model = model

    def start_draining(self) -> None:
        self.draining = True

    def ready_model(self) -> LoadedModel:
        """The model to serve a request with; Draining (the client retries elsewhere or later) while the
        model loads or the server drains."""
        if self.draining:
            raise Draining("the server is shutting down: retry on another replica")
        if self.model is None:
            raise Draining("the model is still loading: retry when health reports SERVING")
        return self.model
