"""The OpenAI-compatible HTTP API, and the HTTP application that also serves Anthropic's Messages API
(serve/api/anthropic/): wire objects (protocol), each route's body → scheduler translation (translate_*.py,
sharing translate.py; structured_output), token logprobs (logprobs), a request's choices as they run
(request_events), the generation routes' one serving skeleton (serving) and each route's renderer
(completions, chat, responses), the FastAPI app and its routes (app), calls accounted and errors answered
(errors), the ASGI front door (front_door, paths) and uvicorn on the event loop (http_server)."""
