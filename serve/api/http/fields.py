"""The fields every HTTP API's generation body takes, whatever its wire format (OpenAI's routes in
serve/api/openai/protocol.py, Anthropic's in serve/api/anthropic/protocol.py): the model, sampling, stopping,
streaming, vLLM's extra sampling parameters and the priority."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from serve.api.validation import PRIORITY_HEADER, PRIORITY_MAX, PRIORITY_MIN

# What /openapi.json says of a list the routes check themselves (not pydantic, whose message would not name
# the empty field).
AT_LEAST_ONE = Field(json_schema_extra={"minItems": 1})


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # each API refuses the extras that would change the output


class SamplingFields(_Body):
    """What every generation route takes (/v1/responses too): the model, sampling, stopping, streaming."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0: greedy")
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool | None = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in -100..100"
    )
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, description="1: off")
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    num_speculative_tokens: int | None = Field(
        None,
        ge=0,
        description="with a speculating server: the most tokens it proposes per step for this request, at "
        "most the server's (default: the server's; 0: none); the output is the same either way",
    )
    # Strict: a float or a string is refused rather than rounded or parsed (a 400 naming the field).
    priority: StrictInt | None = Field(
        None,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="under the server's --scheduling-policy priority: lower is admitted first, arrival order "
        f"among equals (default 0; the {PRIORITY_HEADER} header where the body has none)",
    )
