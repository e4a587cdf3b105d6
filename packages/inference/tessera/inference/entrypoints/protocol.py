"""Request bodies of the HTTP API: OpenAI completions/chat (with vLLM's sampling extensions) and
Megatron's PUT /api. Responses are plain dicts built in server/, in OpenAI's exact shapes.

Types are strict: a boolean is no integer (`prompt: [true]` is a 400) and a string is no
boolean (`stream: "yes"` is a 400); an integer is accepted where a number is expected. Unknown
fields are ignored (as OpenAI-compatible servers do) so newer clients keep working, except the
fields of features this server does not have (UNSUPPORTED_FIELDS), which are refused rather than
silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from tessera.inference.core.generation_defaults import GenerationDefaults
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.structured_spec import StructuredSpec

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]  # strict still takes an integer, never a bool or a string

# Request fields of features not implemented here: a request that sets one (to anything but
# its "off" value) gets a 400 naming the field. Value: the values that mean "off".
# docs/cli/tessera-serve.md lists every request field: honoured, accepted and ignored (`user`,
# `metadata`: labels that change nothing), or refused here.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    # vLLM extensions
    "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1),
    "prompt_logprobs": (None,),
    "logits_processors": (None,),
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "chat_template": (None,),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "priority": (None, 0),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "structural_tag": (None,),
}


class _Body(BaseModel):
    # Unknown fields are kept (not validated, not used) so that unsupported_field can see them.
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def unsupported_field(self) -> str | None:
        """The first field set that asks for a feature this server does not have, if any."""
        extra = self.model_extra or {}
        for name, off in UNSUPPORTED_FIELDS.items():
            if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in off):
                return name
        return None


class FieldError(ValueError):
    """A request field that is well-typed but cannot be served as given (HTTP 400 naming it)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# vLLM's names of the grammar backends it can use; this server has one (llguidance, which vLLM
# calls "guidance"), so "auto" or that one is accepted and any other is refused.
GRAMMAR_BACKENDS = (None, "auto", "guidance", "llguidance")
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


class _JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema; other keys are ignored, as in the request body."""

    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None


class _StructuredOutputs(BaseModel):
    """vLLM's structured_outputs, the keys this server takes (others are refused before this)."""

    model_config = ConfigDict(strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _typed(model: type[BaseModel], value: dict[str, Any], param: str) -> Any:
    """`value` as `model`, strictly typed; FieldError naming `param` and the key otherwise."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in (param, *err["loc"]))
        raise FieldError(param, f"{where}: {err['msg']}") from None


class StreamOptions(_Body):
    include_usage: Bool = Field(False, description="Send a last chunk with token usage.")


class _SamplingFields(_Body):
    model: str | None = None
    n: Int = Field(1, ge=1, le=16, description="Completions per prompt.")
    stream: Bool = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = Field(None, description="Default 1.0; 0 (or below 1e-5) = greedy.")
    top_p: Float | None = None
    top_k: Int | None = Field(None, ge=-1, description="vLLM extension; -1 or 0 = off.")
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: Bool = True
    user: str | None = None
    # JSON object keys are strings; pydantic turns "50256" into 50256 and refuses "abc".
    logit_bias: dict[int, Float] | None = Field(None, description="Token id -> bias in [-100, 100] (OpenAI).")
    # Structured output (structured.py): OpenAI's response_format and vLLM's extras.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_spec(self) -> tuple[StructuredSpec, str] | None:
        """The grammar the request asks for and the field that asked, or None; FieldError if the
        fields are malformed or more than one asks."""
        if self.guided_decoding_backend not in GRAMMAR_BACKENDS:
            raise FieldError("guided_decoding_backend", f"{self.guided_decoding_backend!r} is not available; this "
                             "server's grammar engine is llguidance (\"guidance\"); leave it out or use \"auto\"")
        found: list[tuple[StructuredSpec, str]] = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                found.append((spec, "response_format"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((StructuredSpec(kind=kind, value=getattr(self, name)), name))
        if self.structured_outputs is not None:
            asked = {k: v for k, v in self.structured_outputs.items() if v is not None and v is not False}
            unknown = sorted(set(asked) - set(_STRUCTURED_KEYS))
            if unknown:
                raise FieldError("structured_outputs", f"{', '.join(unknown)} not supported; use one of "
                                 f"{', '.join(_STRUCTURED_KEYS)}")
            _typed(_StructuredOutputs, asked, "structured_outputs")
            for key, value in asked.items():
                found.append((StructuredSpec(kind=_STRUCTURED_KEYS[key], value=None if key == "json_object" else value),
                              "structured_outputs"))
        if len(found) > 1:
            raise FieldError(found[1][1], f"only one structured output constraint per request ({found[0][1]} is set too)")
        return found[0] if found else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int = 0,
                        prompt_logprobs: bool = False, structured: StructuredSpec | None = None,
                        defaults: GenerationDefaults | None = None) -> SamplingParams:
        """Build (and validate) the engine's SamplingParams; pydantic errors surface as 400s.

        With n > 1 and a seed, completion i uses seed + i so the n choices differ reproducibly.
        A sampling field the request leaves out (None) takes the model's default from `defaults`
        (--generation-config), else SamplingParams' own.
        """
        d = defaults or GenerationDefaults()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + index
        values: dict[str, Any] = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=d.get("temperature", self.temperature),
            top_p=d.get("top_p", self.top_p), top_k=d.get("top_k", None if self.top_k is None else max(self.top_k, 0)),
            min_p=d.get("min_p", self.min_p),
            repetition_penalty=d.get("repetition_penalty", self.repetition_penalty), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed, stop=stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias, prompt_logprobs=prompt_logprobs,
            structured=structured,
        )
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})


def _response_format(fmt: dict[str, Any]) -> StructuredSpec | None:
    if fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format", f"type {fmt.get('type')!r} is not supported; use text, json_object or "
                         "json_schema")
    typed = _typed(_ResponseFormat, fmt, "response_format")
    if typed.type == "text":
        return None
    if typed.type == "json_object":
        return StructuredSpec(kind="json_object")
    if typed.json_schema is None:
        raise FieldError("response_format", "json_schema must be an object with a schema")
    if typed.json_schema.schema_ is None:
        return StructuredSpec(kind="json_object")
    return StructuredSpec(kind="json", value=typed.json_schema.schema_)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(16, description="Most tokens to generate per choice.")
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: Bool = False
    add_special_tokens: Bool = Field(True, description="Tokenize text prompts with the tokenizer's special tokens (BOS), as vLLM.")
    suffix: str | None = None
    best_of: Int | None = Field(None, description="Accepted only equal to n (no candidate ranking).")

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_bool_ids(cls, v: Any) -> Any:
        # Without this, pydantic's error for [true] names the first union member ("prompt.str").
        if isinstance(v, list) and any(isinstance(x, bool) or (isinstance(x, list) and any(isinstance(y, bool) for y in x))
                                       for x in v):
            raise ValueError("token ids must be integers, not booleans")
        return v


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

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
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = Field(False, description="Add the tokenizer's special tokens on top of the template's (vLLM).")
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function); FieldError when the
        tools or the choice are malformed."""
        from tessera.inference.entrypoints.tools import valid_function_name

        tools = self.tools or []
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise FieldError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
            if not valid_function_name(fn.get("name")):
                raise FieldError("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise FieldError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise FieldError("tools", "function names must be unique")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none":
            return "none", None
        if not tools:
            raise FieldError("tool_choice", "needs tools")
        if choice in ("auto", "required"):
            return choice, None  # type: ignore[return-value]
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            if name not in names:
                raise FieldError("tool_choice", f"function {name!r} is not among the tools")
            return "named", name
        raise FieldError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}')


class MegatronRequest(_Body):
    """PUT /api as Megatron-LM's text generation server takes it."""

    prompts: list[str]
    tokens_to_generate: Int = 64
    logprobs: Bool = False
    temperature: Float = 1.0
    top_k: Int = 0
    top_p: Float = 0.0
    add_BOS: Bool = False
    random_seed: Int = -1
    stop_on_eol: Bool = False
    stop_on_double_eol: Bool = False


Role = Literal["system", "user", "assistant", "tool"]


class TokenizeRequest(_Body):
    """POST /tokenize as vLLM takes it: a `prompt` (completions form) or `messages` (chat form)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = Field(None, description="Default true for a prompt, false for messages (vLLM).")
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: Bool = False


class DetokenizeRequest(_Body):
    """POST /detokenize as vLLM takes it."""

    model: str | None = None
    tokens: list[Int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _no_bool_ids(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(x, bool) for x in v):
            raise ValueError("token ids must be integers, not booleans")
        return v


class EmbeddingRequest(_Body):
    """POST /v1/embeddings as OpenAI takes it, with vLLM's truncate_prompt_tokens and add_special_tokens."""

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, description="Shorter vectors, for Matryoshka models only.")
    user: str | None = None
    truncate_prompt_tokens: Int | None = Field(
        None, ge=-1, description="Keep the first k tokens of a longer input (-1: the longest this server embeds).")
    add_special_tokens: Bool = Field(True, description="Tokenize text inputs with the tokenizer's special tokens, "
                                                       "as sentence-transformers does.")

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        # One message for every wrong shape (pydantic's would name a union member: "input.str").
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(y, int) and not isinstance(y, bool) for y in x)

        if not (isinstance(v, str) or (isinstance(v, list) and (ids(v) or all(isinstance(x, str) for x in v)
                                                                or all(ids(x) for x in v)))):
            raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of "
                             "token-id lists")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: one text or token-id list each."""
        raw = self.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [raw]  # type: ignore[list-item]
        return list(raw)  # type: ignore[arg-type]


# Fields of vLLM's and Cohere's score/rerank requests that this server leaves out, with the values
# that mean "off" (a client may send them as defaults). Any other value, or any other field, is a 400.
_SCORE_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "priority": (None, 0), "mm_processor_kwargs": (None,), "use_activation": (None,), "activation": (None,),
    "softmax": (None,), "max_tokens_per_doc": (None,), "relevant_spans": (None,), "rank_fields": (None,),
}


class _ScoreBody(_Body):
    """Score and rerank bodies refuse every field they do not declare (not only UNSUPPORTED_FIELDS):
    they are small, fixed APIs, and a client that sets a field (`use_activation`, `max_tokens_per_doc`,
    multi-modal `data_1`) expects its effect, which a bi-encoder's cosine would silently drop."""

    def unsupported_field(self) -> str | None:
        for name, value in (self.model_extra or {}).items():
            if not any(value == v and type(value) is type(v) for v in _SCORE_OFF_VALUES.get(name, ())):
                return name
        return None


def _texts(v: Any, what: str) -> Any:
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
        raise ValueError(f"must be {what}")
    return v


class ScoreRequest(_ScoreBody):
    """POST /score, /v1/score as vLLM takes it for a bi-encoder: text_1 against text_2, 1-to-1, 1-to-N
    (text_1 one text) or N-to-N (pairwise, equal lengths); each score the cosine of the two embeddings."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int | None = Field(
        None, ge=-1, description="Keep the first k tokens of a longer text (-1: the longest this server embeds).")
    user: str | None = None

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        return _texts(v, "a string or a list of strings")

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) of each score, in order; FieldError for lengths that are not 1:1, 1:N or N:N."""
        one = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        two = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        for name, texts in (("text_1", one), ("text_2", two)):
            if not texts:
                raise FieldError(name, "must not be empty")
        if len(one) == 1:
            return [(one[0], t) for t in two]
        if len(one) != len(two):
            raise FieldError("text_2", f"has {len(two)} texts and text_1 {len(one)}: send one text_1 (1-to-N) or "
                                       "lists of equal length (N-to-N, pairwise)")
        return list(zip(one, two))


class RerankRequest(_ScoreBody):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape, as vLLM serves it): documents
    ranked by the cosine of their embedding with the query's, highest first, cut to top_n."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: Int | None = Field(None, ge=0, description="Return the best top_n documents (0 or absent: all).")
    return_documents: Bool = Field(True, description="Echo each document's text in its result.")
    truncate_prompt_tokens: Int | None = Field(
        None, ge=-1, description="Keep the first k tokens of a longer text (-1: the longest this server embeds).")
    user: str | None = None

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        # vLLM also takes {"text": ...} objects (its multi_modal documents are not served here).
        if isinstance(v, list):
            v = [x["text"] if isinstance(x, dict) and set(x) == {"text"} else x for x in v]
        return _texts(v if isinstance(v, list) else None, 'a list of strings or of {"text": string} objects')
