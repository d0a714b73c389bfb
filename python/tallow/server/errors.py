"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""
from __future__ import annotations

import json
from typing import Optional

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(self, message: str, status: int = 400, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.to_dict()), content_type="application/json",
                            headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def internal_error() -> APIError:
    return APIError("internal server error; the server log has the details", 500, code="internal_error")
