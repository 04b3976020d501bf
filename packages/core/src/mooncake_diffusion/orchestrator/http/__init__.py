"""The HTTP front: the FastAPI app and dashboard, the OpenAI routes, limits and bodies, the
front process, the remote service and the client.
"""
