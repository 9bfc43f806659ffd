"""The serving state both front ends read and only the lifecycle (`serve.api.lifecycle`) changes: the loaded
model (none while it loads), whether the server is draining, and whether its gRPC server is stopping."""

from __future__ import annotations

from serve.api.common import LoadedModel
from serve.errors import Draining


class ServingState:
    """Loading (no model yet) -> ready (`loaded`) -> draining (`start_draining`, also when the engine process
    dies) -> stopping (`stop_grpc`: gRPC's server stops, and cancels the calls still running when its grace
    ends). A draining server stays draining: the process then stops."""

    def __init__(self) -> None:
        self.model: LoadedModel | None = None
        self.draining = False
        self.stopping = False

    def loaded(self, model: LoadedModel) -> None:
        self.model = model

    def start_draining(self) -> None:
        self.draining = True

    def stop_grpc(self) -> None:
        self.stopping = True

    def ready_model(self) -> LoadedModel:
        """The model to serve a request with; Draining (the client retries elsewhere or later) while the
        model loads or the server drains."""
        if self.draining:
            raise Draining("the server is shutting down: retry on another replica")
        if self.model is None:
            raise Draining("the model is still loading: retry when health reports SERVING")
        return self.model
