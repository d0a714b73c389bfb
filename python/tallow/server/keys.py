"""The application key under which the app keeps its ServerState."""
from aiohttp import web

STATE = web.AppKey("tallow_server_state", object)
# when the request arrived (for latency metrics); RequestKey is aiohttp >= 3.12
T0 = web.RequestKey("tallow_t0", float) if hasattr(web, "RequestKey") else "tallow_t0"
