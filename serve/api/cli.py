"""`textgen-serve` / `python -m serve`: parse the configuration, run the server until SIGTERM or SIGINT.

Exit codes: 0 after a clean drain, 1 when start-up fails (bundle, providers, port) or the engine process dies,
2 for bad configuration.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from serve.api.config import ConfigError, load_settings
from serve.errors import TextgenError
from serve.process import configure_logging
from serve.scheduling.engine_client import EngineProcess

log = logging.getLogger("textgen.serve")

# Start-up failures that are the operator's to fix: one clear line, no traceback (ImportError: an install
# without ONNX Runtime, found when the engine is built).
EXPECTED_STARTUP_ERRORS = (ConfigError, TextgenError, ValueError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"textgen-serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    # Started before the front end's modules are imported, so that the engine process imports its own
    # meanwhile (docs/architecture.md, "Start-up order"); a spawned child imports this module again: it
    # stays light.
    runs = not (settings.print_pod_memory or settings.prepare_only)
    engine = EngineProcess() if settings.engine_process and runs else None
    try:
        from serve.api.lifecycle import serve
        from serve.api.loading import pod_memory_report, prepare_serving_graph

        if settings.print_pod_memory:
            print(pod_memory_report(settings))
            return 0
        if settings.prepare_only:
            print(prepare_serving_graph(settings))
            return 0
        return asyncio.run(serve(settings, engine))
    except EXPECTED_STARTUP_ERRORS as exc:
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        if engine is not None:
            engine.close()
