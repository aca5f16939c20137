"""OpenAI-shaped error bodies and the exception that carries one out of a handler."""

from __future__ import annotations

from aiohttp import web

# HTTP status -> the error type vLLM's OpenAI server names in its error bodies
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    505: "HTTPVersionNotSupportedError",
}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, object]]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.headers.get("Connection") == "close":
            response.force_close()  # e.g. a stalled body: the connection is not reusable
        return response


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
