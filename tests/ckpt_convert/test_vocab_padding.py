"""Vocabulary padding (model.vocab_size_divisible_by): a vocabulary that no tensor-parallel size
divides (GPT-2's 50257, an odd one) is padded with zero rows whose logits are -inf, so the padded
model computes exactly what the unpadded one does; import pads, reshard re-pads, exports cut the
padding off (bit-identical to the original Hugging Face tensors), and serving is unchanged."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from ckpt_helpers import make_tokenizer
from safetensors.torch import load_file

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout, validate_layout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import build_model

CFG = ModelConfig(vocab_size=1001, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                  max_seq_len=64)


def test_megatron_rule_pads_to_a_multiple_of_divisible_by_times_tensor_parallel():
    assert CFG.padded_for(1).vocab_rows == 1024
    assert CFG.padded_for(2).vocab_rows == 1024
    assert CFG.padded_for(8).vocab_rows == 1024 * 1  # 128 x 8 = 1024
    assert CFG.padded_for(16).vocab_rows == 2048
    gpt2 = CFG.model_copy(update={"vocab_size": 50257})
    assert gpt2.padded_for(1).vocab_rows == 50304 and gpt2.padded_for(4).vocab_rows == 50688
    assert CFG.model_copy(update={"vocab_size": 1024}).padded_for(2).padded_vocab_size is None  # already a multiple
    # A checkpoint keeps its rows wherever they divide; re-padded only where they do not.
    odd = CFG.model_copy(update={"vocab_size_divisible_by": 1}).padded_for(1)
    assert odd.vocab_rows == 1001 and odd.refit_for(1) is odd and odd.refit_for(2).vocab_rows == 1002
    with pytest.raises(UserError, match="pad the vocabulary"):
        validate_layout(odd, ParallelLayout(tensor=2))


@pytest.mark.parametrize("tied", [True, False])
def test_padded_model_computes_what_the_unpadded_model_computes(tied):
    """Same seed: the real rows are the same weights (padding draws nothing); the padded logits are
    -inf; loss and gradients of the real weights equal the unpadded model's, padded rows get none."""
    plain_cfg = CFG.model_copy(update={"tie_embeddings": tied})
    padded_cfg = plain_cfg.padded_for(2)
    plain, padded = build_model(plain_cfg, seed=3), build_model(padded_cfg, seed=3)
    head = "embed_tokens.weight" if tied else "lm_head.weight"
    for name, p in padded.named_parameters():
        want = plain.state_dict()[name]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            assert p.shape[0] == 1024 and torch.equal(p[:1001], want) and not p[1001:].any()
        else:
            assert torch.equal(p, want), name
    tokens = torch.randint(0, 1001, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = padded(tokens[:, :-1])
    assert logits.shape[-1] == 1024 and torch.isneginf(logits[..., 1001:]).all()
    want_logits = plain(tokens[:, :-1])
    assert torch.equal(logits[..., :1001], want_logits)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    want = F.cross_entropy(want_logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    want.backward()
    assert torch.equal(loss, want)
    g, w = padded.get_parameter(head).grad, plain.get_parameter(head).grad
    assert (g[:1001] - w).norm() / w.norm() < 1e-6 and not g[1001:].any()


def test_chunked_loss_masks_the_padding_like_the_head():
    from tessera.trainer.objectives.loss import chunked_cross_entropy

    model = build_model(CFG.padded_for(1), seed=0)
    with torch.no_grad():
        model.lm_head.weight[1001:] = 5.0  # padded rows that would win if they counted
    tokens = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(1))
    hidden = model(tokens[:, :-1], return_hidden=True)
    full = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    chunked = chunked_cross_entropy(hidden, model.lm_head.weight, tokens[:, 1:], 5, vocab_size=1001)
    assert torch.allclose(chunked, full, rtol=1e-6)


def test_vocab_parallel_loss_ignores_padded_columns(one_process_group):
    """The tensor-parallel head's logits (one rank, vocab_start 0) through the vocab-parallel loss
    equal F.cross_entropy over the real vocabulary."""
    from tessera.common.parallel.loss import vocab_parallel_cross_entropy

    model = build_model(CFG.padded_for(1), seed=0)
    hidden = torch.randn(6, 32)
    logits = model.logits(hidden, model.lm_head.weight, vocab_start=0)
    target = torch.randint(0, 1001, (6,))
    got = vocab_parallel_cross_entropy(logits, target, one_process_group)
    want = F.cross_entropy(hidden @ model.lm_head.weight[:1001].t(), target, reduction="none")
    assert torch.allclose(got, want, atol=1e-6)


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _hf_gpt2(vocab: int, tied: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                    bos_token_id=None, eos_token_id=None, tie_word_embeddings=tied))
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(20.0)  # well-separated greedy choices
    return hf.eval()


def _hf_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(20.0)
    return hf.eval()


def greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the server's engine over a checkpoint or an HF directory."""
    from tessera.inference.config import EngineConfig
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    engine = LLMEngine(load_for_serving(model_dir, torch.device("cpu"), torch.float32),
                       EngineConfig(num_kv_blocks=16, block_size=8), torch.device("cpu"), torch.float32)
    out: list[int] = []
    engine.add_request("a", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    engine.run_to_completion(lambda o: out.extend(o.new_token_ids))
    return out


CASES = {  # name: (model, import --vocab-size-divisible-by, rows after import, rows after reshard TP2/PP2)
    "gpt2-50257-tied": (lambda: _hf_gpt2(50257, True), 128, 50304, 50304),
    "llama-odd-1001-untied": (lambda: _hf_llama(1001), 128, 1024, 1024),
    "llama-odd-1001-unpadded-then-repadded": (lambda: _hf_llama(1001), 1, 1001, 1002),
}


@pytest.mark.parametrize("name", list(CASES))
def test_import_reshard_tp2_pp2_export_is_bit_identical_and_serves_the_same(tmp_path, name):
    make_hf, divisible_by, imported_rows, resharded_rows = CASES[name]
    hf = make_hf()
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    tok = make_tokenizer(tmp_path / "tok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, src / f)
    assert run(["import", "--format", "hf", "--input", str(src), "--output", str(tmp_path / "ck"), "--quiet",
                "--vocab-size-divisible-by", str(divisible_by)]) == 0
    imported = read_sidecar(resolve_checkpoint(tmp_path / "ck")).model
    assert imported.vocab_size == hf.config.vocab_size and imported.vocab_rows == imported_rows
    assert run(["reshard", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "tp2pp2"),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", "--quiet"]) == 0
    resharded = resolve_checkpoint(tmp_path / "tp2pp2")
    assert read_sidecar(resharded).model.vocab_rows == resharded_rows
    embed = load_model_tensors(resharded)["embed_tokens.weight"]
    assert embed.shape[0] == resharded_rows and not embed[hf.config.vocab_size:].any()
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "tp2pp2"), "--output",
                str(tmp_path / "out"), "--quiet"]) == 0
    original, exported = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) <= set(original)
    for k, v in exported.items():
        assert v.dtype == original[k].dtype and torch.equal(v, original[k]), k
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == hf.config.vocab_size
    # Served from the padded, resharded checkpoint: the tokens of the original directory.
    prompt = [4, 9, 200, 31, 77, 5, 6, 7, 8, 120, 3]
    assert greedy(resharded, prompt, 10) == greedy(src, prompt, 10)
