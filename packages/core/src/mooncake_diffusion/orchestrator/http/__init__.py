"""The HTTP front: FastAPI app, OpenAI routes, limits, front process, remote service, client."""
