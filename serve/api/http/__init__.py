"""What the HTTP APIs share, below them (serve/api/openai/ and serve/api/anthropic/ import it, it imports
neither): the routes' paths (paths), the ASGI front door (front_door), calls accounted and errors answered
(errors), the generation routes' one serving skeleton (serving) and a request's choices as they run
(request_events), and uvicorn on the event loop (server)."""
