"""What every route reads of its request, below both route packages (``routes`` and the Batch
API's ``batches``): the server's state, and the body the gate read, validated."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from batchline.server.errors import validation_error
from batchline.server.state import ServerState

__all__ = ["parse_body", "server_state"]

M = TypeVar("M", bound=BaseModel)


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def parse_body(request: Request, model: type[M]) -> M:
    """The body the gate read, validated as ``model``; a 422 that never echoes the input."""
    body = request.scope.get("batchline.body")
    if body is None:
        body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        for err in errors:
            err["loc"] = ("body", *err["loc"])
        raise validation_error(errors) from None
