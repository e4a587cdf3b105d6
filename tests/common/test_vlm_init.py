"""The vision-language model's per-module init (what sharded initialisation replays on the meta
device): a seed's one-process weights are those drawn before it existed, bit for bit, and drawing
one module at a time in `init_order`, each alone at its global shape, gives those same weights.
CLIP (class token) and SigLIP (pooling head: its `probe` is drawn after the head's submodules),
with 11 tower blocks so that name order puts `layers.10` before `layers.2`."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from tessera.common.models import registry

# sha256 of build_model(cfg, seed=0)'s state dict (sorted names and bytes), from the parameter-wise
# init_weights that preceded init_module / init_order.
BEFORE = {"clip": "13f57ef713b21a0db5c2161ae2f82e07d2739eb4767cf9f7126ded420af62bf8",
          "siglip": "3df8ea887eff74357d5a6db3c02c47b12913b16030a9c80e66e3c04db93ed4d8"}


def _cfg(tower: str):
    text = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=32,
                max_seq_len=32, tie_embeddings=tower == "siglip")
    if tower == "siglip":
        text["attention_bias"] = ["q", "k", "v"]
    vision = dict(arch=tower, hidden_size=8, num_layers=11, num_heads=2, ffn_hidden_size=16, image_size=16,
                  patch_size=8, head=tower == "siglip")
    return registry.model_config(dict(kind="vision_language", vision=vision, text=text, image_token_id=60,
                                      projector=dict(bias=tower == "clip")))


def _sha256(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_a_seeds_one_process_weights_are_unchanged_bit_for_bit(tower):
    cfg = _cfg(tower)
    assert _sha256(registry.kind_of(cfg).build(cfg, seed=0).state_dict()) == BEFORE[tower]


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_one_module_at_a_time_in_init_order_draws_the_one_process_weights(tower):
    """As sharded_init.materialize_stages replays it: a meta-built model's modules, each copied,
    allocated alone and initialised with one generator."""
    cfg = _cfg(tower)
    want = registry.kind_of(cfg).build(cfg, seed=0).state_dict()
    whole = registry.kind_of(cfg).build(cfg, device="meta", seed=None)
    modules = dict(whole.named_modules())
    generator = torch.Generator().manual_seed(0)
    got: dict[str, torch.Tensor] = {}
    for name in whole.init_order():
        tmp = copy.deepcopy(modules[name])
        tmp.to_empty(device="cpu")
        whole.init_module(name, tmp, generator)
        got.update({f"{name}.{p}": v for p, v in tmp.named_parameters(recurse=False)})
    params = dict(whole.named_parameters())
    assert got.keys() == params.keys()
    assert all(torch.equal(got[k], want[k]) for k in got), [k for k in got if not torch.equal(got[k], want[k])][:3]
    if tower == "siglip":  # the probe's draw comes after the head's attention, MLP and norm
        order = whole.init_order()
        assert order.index("vision.head") > order.index("vision.head.norm")
