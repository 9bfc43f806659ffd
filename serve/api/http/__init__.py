"""What the HTTP APIs share, below them (serve/api/openai/ and serve/api/anthropic/ import it; it imports
neither): the app and the handlers' shared parts (app), the routes' paths (paths), the ASGI front door
(front_door), calls accounted and errors answered (errors), the generation routes' one serving skeleton
(serving) and a request's choices as they run (request_events), the sampling fields every body takes
(fields), the translation every route shares and the chat plan (translate), constraints (constraints),
token texts (vocabulary), and uvicorn on the event loop (server)."""
