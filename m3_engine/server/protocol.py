"""The OpenAI protocol of ``m3-serve``: request bodies (pydantic models) and the error body.

Request models keep unknown fields (``extra="allow"``: OpenAI-compatible servers ignore
them); the routes (``m3_engine.server.app``) refuse fields this engine cannot honour.
"""

from __future__ import annotations

from typing import Any, Optional, Union

try:   # first: without the server's packages, name the extra that installs them
    import fastapi  # noqa: F401
    import pydantic  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"m3-serve needs FastAPI, uvicorn and pydantic ({e.name} is missing): "
                              "pip install 'm3-msa-kernels[server]'", name=e.name) from None
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

__all__ = ["APIError", "bad", "param_of", "StreamOptions", "GenerationRequest", "CompletionRequest",
           "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"]


# -- errors ------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 (``invalid_request_error``) naming the request field ``param``."""
    return APIError(400, message, param=param, code=code)


def param_of(error: Exception, rename: Optional[dict] = None) -> Optional[str]:
    """The field an engine error names (``"temperature: expected ..."`` -> ``"temperature"``,
    ``"structured_outputs.json: ..."`` -> ``"structured_outputs"``)."""
    head = str(error).split(":", 1)[0].split("[", 1)[0].split(".", 1)[0].strip()
    if not head.isidentifier():
        return None
    return (rename or {}).get(head, head)


# -- request models ----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = False


class GenerationRequest(BaseModel):
    """The fields completions and chat share (OpenAI's, then vLLM's extensions)."""
    model_config = ConfigDict(extra="allow")   # unknown fields are ignored, as OpenAI-compatible servers do

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    bad_words: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    prompt_logprobs: Optional[int] = None
    # constrained output (m3_engine.server.chat): OpenAI's, and vLLM's {json|regex|choice|grammar|json_object}
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    echo: Optional[bool] = False
    add_generation_prompt: bool = True
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape)."""
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids -> text."""
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int]
