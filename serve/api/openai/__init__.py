"""The OpenAI-compatible HTTP API: wire objects (protocol), the body → scheduler translation (translate,
structured_output), token logprobs (logprobs), a request's choices as they run (request_events), the
generation routes' one serving skeleton (serving) and each route's renderer (completions, chat), the
Responses route (responses), the FastAPI app and its routes (app), calls accounted and errors answered
(errors), the ASGI front door (front_door, paths) and uvicorn on the event loop (http_server)."""
