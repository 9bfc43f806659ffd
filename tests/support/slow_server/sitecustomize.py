"""Python imports this at start-up in every process of a test's server (`ServerProcess` puts this folder on
PYTHONPATH): the server's own and its engine process. With SLOW_DECODE_SECONDS set, every decode step of the
engine sleeps that long first, so streams are still running when a test signals or kills the server (test
instrumentation only: the scheduler and the server are the product's)."""

import os

_SECONDS = float(os.environ.get("SLOW_DECODE_SECONDS", "0"))

if _SECONDS > 0:
    import time

    import serve.engine.engine
    import serve.engine.types

    _decode = serve.engine.engine.Engine.decode

    def _slow_decode(self: serve.engine.engine.Engine) -> list[serve.engine.types.TokenOut]:
        time.sleep(_SECONDS)
        return _decode(self)

    serve.engine.engine.Engine.decode = _slow_decode  # type: ignore[method-assign]
