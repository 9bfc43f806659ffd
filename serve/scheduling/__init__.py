"""Pure Python between the front end and the engine: the request's state machine (request.py), its checks
(request_checks.py) and text (textstream.py), the admission policy (planner.py: a step plan, tested without an
engine), the loop that runs plans on the engine (runner.py, over intake.py and delivery.py) within its limits
(limits.py), what it needs of an engine (engine_protocol.py), the request handles on the event loop
(handles.py), the engine on a thread (scheduler.py) or in a process of its own (engine_core.py in the child,
engine_client.py in the server, messages.py between them), and the offline API (offline.py). It never imports
onnxruntime or a protocol library."""
