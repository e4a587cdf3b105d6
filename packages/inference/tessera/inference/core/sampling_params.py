"""Per-request generation settings (OpenAI + vLLM extensions), validated once at the door.

Every value accepted here must be safe to sample with: the ranges below are what keeps the
sampler finite (a division by temperature 5e-324 or by repetition_penalty 1e-45 overflows to inf,
and inf - inf is NaN, which torch.multinomial refuses), and the sampler has a last guard of its
own (sampler.py). Token ids that must lie inside the vocabulary are checked against the model by
`llm_engine.validate_request`.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from tessera.common.config import StrictModel
from tessera.inference.core.image_inputs import ImageInput
from tessera.inference.core.structured_spec import StructuredSpec

# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing logits by a smaller
# one overflows float32 (5e-324 is a float64 denormal; 1e-45 is float32's smallest), and well
# before that the distribution is a one-hot of the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# A stop list is scanned after every token; a request cannot make that scan arbitrarily long
# (350k stop strings once kept an engine busy for 80 s).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
INT64_MAX = 2**63 - 1


class SamplingParams(StrictModel):
    """How one request picks its tokens and when it stops."""

    max_tokens: int = Field(16, ge=0, description="Most tokens to generate (0 only with prompt_logprobs).")
    min_tokens: int = Field(0, ge=0, description="EOS and stop token ids are suppressed until this many tokens exist.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description=f"Below {GREEDY_TEMPERATURE_EPS} = greedy; otherwise logits are divided by it.")
    top_k: int = Field(0, ge=0, le=INT64_MAX, description="Keep the k most likely tokens (0 = all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the smallest set of tokens whose probability mass reaches p.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens whose probability is below min_p x the top probability.")
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, description="Divide positive (multiply negative) logits of tokens already in prompt or output (CTRL/HF).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtract from logits of tokens present in the output (OpenAI).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtract count x this from logits of tokens in the output (OpenAI).")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1,
                             description="Seed of this request's own generator (a 64-bit integer): same seed, same tokens, whatever the batch.")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                            description="Stop strings; the output ends before the first match.")
    stop_token_ids: list[int] = Field(default_factory=list,
                                      description="Token ids that end generation (not included in the text); in the vocabulary.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (vLLM extension; for benchmarks).")
    logprobs: int | None = Field(None, ge=0, le=20, description="Return the sampled token's logprob and the top-n alternatives.")
    prompt_logprobs: bool = Field(False, description="Also return the logprob of every prompt token after the first (disables prefix-cache reuse for it).")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the returned text.")
    structured: StructuredSpec | None = Field(
        None, description="A grammar the output must match (JSON schema, any JSON object, regex, choice, Lark).")
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description="Token id -> value in [-100, 100] added to its logit before sampling (OpenAI).")

    embed: bool = Field(False, description="A pooling request (/v1/embeddings): its prompt is computed whole in one step "
                                           "and pooled; nothing is generated (max_tokens 0).")
    images: list[ImageInput] = Field(default_factory=list, description="A vision-language request's images, "
                                     "decoded by the HTTP process (core/image_inputs.py).")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers >= 0)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.embed and (self.max_tokens or self.prompt_logprobs):
            raise ValueError("an embed request generates nothing: max_tokens 0, no prompt_logprobs")
        if self.max_tokens == 0 and not self.prompt_logprobs and not self.embed:
            raise ValueError("max_tokens must be >= 1")
        if self.structured is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output (the grammar decides where "
                             "the output ends)")
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1
