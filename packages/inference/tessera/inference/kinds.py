"""What tessera-serve runs for each model kind: its model runner and cache under the hook names the
kind registry gives (tessera.common.models.registry). `serving_kind` refuses a kind it has no
code for in one line; the loader asks it before any weight is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.common.models.registry import stage_hook
from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.state_manager import StateBlockManager
from tessera.inference.pooling.encoder import EncoderRunner, NoKVCache
from tessera.inference.pooling.runner import DecoderRunner
from tessera.inference.worker.encoder_decoder.cache import CrossBlockManager
from tessera.inference.worker.encoder_decoder.runner import EncoderDecoderRunner
from tessera.inference.worker.latent.runner import LatentRunner
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.multimodal.runner import VisionLanguageRunner
from tessera.inference.worker.state.runner import HybridRunner

STAGE = "tessera-serve"


@dataclass(frozen=True)
class ServingKind:
    runner: type[ModelRunner]  # executes a scheduled step over the model and its cache
    cache: type[BlockManager]  # hands out the cache's blocks to sequences

    @property
    def generates(self) -> bool:
        """False for a kind served as embeddings only (an encoder): completions and chat are refused."""
        return getattr(self.runner, "generates", True)

    @property
    def scores_prompts(self) -> bool:
        """False where prompt logprobs mean nothing (an encoder-decoder's prompt is its encoder input)."""
        return getattr(self.runner, "scores_prompts", True)

    @property
    def tensor_parallel_problem(self) -> Callable[[int, Any], str | None] | None:
        """(tp, config) -> why the config cannot be served over tp tensor ranks (a phrase) or None:
        the runner's own; None when its runner has no tensor-parallel worker path."""
        return getattr(self.runner, "tensor_parallel_problem", None)

    def hidden_size(self, cfg: Any) -> int:
        """The width of the hidden states the runner pools (a vision-language model's: its language model's)."""
        width = getattr(self.runner, "hidden_size", None)
        return cfg.hidden_size if width is None else width(cfg)


# paged attention over the decoder stack; it also pools embed requests (pooling/runner.py)
RUNNERS: dict[str, type[ModelRunner]] = {"decoder": DecoderRunner}
RUNNERS["hybrid"] = HybridRunner  # paged attention + Mamba layers over a per-sequence state pool
RUNNERS["vision_language"] = VisionLanguageRunner  # paged, image features over image tokens (worker/multimodal/)
RUNNERS["pooling"] = EncoderRunner  # an encoder: padded batches, pooled (pooling/encoder.py)
RUNNERS["encoder_decoder"] = EncoderDecoderRunner  # encoder once per request, decoder over paged self + cross K/V
RUNNERS["latent"] = LatentRunner  # a causal LM with latent attention (DeepSeek-V3): latent KV cache (worker/latent/)
CACHES: dict[str, type[BlockManager]] = {"paged_kv": BlockManager}  # paged key/value blocks, prefix caching
CACHES["paged_kv_and_state"] = StateBlockManager  # paged K/V of attention layers + one state slot per sequence
CACHES["none"] = NoKVCache  # nothing kept between steps (an encoder)
CACHES["paged_kv_cross"] = CrossBlockManager  # a sequence's cross-attention K/V, then its decoder's, in one table


def serving_kind(model: Any) -> ServingKind:
    """The server's code for `model`'s kind (a config)."""
    runner = stage_hook(model, "serve_runner", RUNNERS, STAGE)
    if getattr(model, "mla", None) is not None and runner is DecoderRunner:  # the causal LM's DeepSeek family
        runner = RUNNERS["latent"]
    return ServingKind(runner=runner,
                       cache=stage_hook(model, "serve_cache", CACHES, STAGE))
