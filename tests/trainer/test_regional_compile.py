"""training.compile_scope on the one-process step: regional compilation ("blocks", the default) trains
like eager and like the whole-graph compile ("model"), and compiles each kind of block once, however
deep the model."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from trainer_fixtures import assert_weights_close

from tessera.common.models.causal_lm.config import preset
from tessera.common.models.causal_lm.model import Block
from tessera.trainer.components.model_setup import compile_blocks, prepare_model
from tessera.trainer.components.optimizer.optim import build_optimizer
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.config import OptimConfig
from tessera.trainer.objectives.step import TrainStep

CPU = torch.device("cpu")


def train(cfg, compile, loss_chunk_tokens: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two AdamW steps of the one-process step; the losses and the weights after."""
    model = prepare_model(cfg, CPU, seed=0)
    optim_cfg = OptimConfig(lr=1e-3, grad_clip=1.0)
    step = TrainStep(model, build_optimizer(model, optim_cfg), Precision("fp32", CPU), optim_cfg.grad_clip,
                     loss_chunk_tokens=loss_chunk_tokens, compile=compile)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
        losses.append(float(step([(tokens[:, :-1], tokens[:, 1:])], 1, CPU)[0]))
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def compiled_block_graphs() -> int:
    """Dynamo's cache entries on the blocks' forward: one per graph compiled for a kind of block."""
    return len(_debug_get_cache_entry_list(Block.forward.__code__))


def test_four_identical_blocks_compile_one_graph_and_train_like_eager():
    cfg = preset("tiny", num_layers=4)  # compiling per depth would give four graphs, the whole model none
    torch._dynamo.reset()
    losses, weights = train(cfg, True)
    assert compiled_block_graphs() == 1
    eager_losses, eager_weights = train(cfg, False)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert_weights_close(weights, eager_weights, "regional compile vs eager")
    # The chunked loss runs over the same compiled blocks (their graph reused: still one).
    losses, weights = train(cfg, True, loss_chunk_tokens=8)
    assert compiled_block_graphs() == 1
    eager_losses, eager_weights = train(cfg, False, loss_chunk_tokens=8)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert_weights_close(weights, eager_weights, "regional compile with loss chunks vs eager")


def test_the_whole_graph_compile_trains_like_eager_and_leaves_no_graph_per_block():
    cfg = preset("tiny", num_layers=1)
    torch._dynamo.reset()
    losses, weights = train(cfg, "model")
    assert compiled_block_graphs() == 0  # the block is traced into the one graph of forward and loss
    eager_losses, eager_weights = train(cfg, False)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert_weights_close(weights, eager_weights, "whole-graph compile vs eager")


def test_a_deep_stack_raises_dynamo_s_recompile_limit_to_cover_every_block():
    # Past the limit Dynamo would run the remaining kinds of block eagerly with only a log line.
    cfg = preset("tiny", num_layers=24)
    with torch._dynamo.config.patch(recompile_limit=8):
        compile_blocks(prepare_model(cfg, CPU, seed=0))  # compiles lazily: nothing traced here
        assert torch._dynamo.config.recompile_limit >= 24
