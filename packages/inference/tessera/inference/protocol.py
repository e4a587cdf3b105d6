"""Request bodies of the HTTP API: OpenAI completions/chat (with vLLM's sampling extensions) and
Megatron's PUT /api. Responses are plain dicts built in server.py, in OpenAI's exact shapes.

Unknown fields are ignored (as OpenAI-compatible servers do) so newer clients keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tessera.inference.sampling_params import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class _SamplingFields(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=16, description="Completions per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, description="Default 1.0; 0 = greedy.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; -1 or 0 = off.")
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    user: str | None = None
    # JSON object keys are strings; pydantic turns "50256" into 50256 and refuses "abc".
    logit_bias: dict[int, float] | None = Field(None, description="Token id -> bias in [-100, 100] (OpenAI).")

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int = 0) -> SamplingParams:
        """Build (and validate) the engine's SamplingParams; pydantic errors surface as 400s.

        With n > 1 and a seed, completion i uses seed + i so the n choices differ reproducibly.
        """
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + index
        values: dict[str, Any] = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=None if self.top_k is None else max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed, stop=stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
        )
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, description="Most tokens to generate per choice.")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, description="Accepted only equal to n (no candidate ranking).")


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class MegatronRequest(_Body):
    """PUT /api as Megatron-LM's text generation server takes it."""

    prompts: list[str]
    tokens_to_generate: int = 64
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    add_BOS: bool = False
    random_seed: int = -1
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False


Role = Literal["system", "user", "assistant", "tool"]
