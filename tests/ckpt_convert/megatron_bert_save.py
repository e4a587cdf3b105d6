"""megatron-core's own BertModel on CPU (its local layer spec, gloo), for test_megatron_bert.py: every
Megatron-side step of that test in one torchrun launch of two processes.

Run as `torchrun --nproc-per-node 2 megatron_bert_save.py WORK.json`. WORK.json lists cases, each a
model `spec` and paths. With tensor parallel 1 (the two ranks data-parallel), for each case: build
the model with random weights (every norm and bias too), save it with dist_checkpointing.save
into `save`, and write its state_dict and its outputs on `inputs` (MLM logits, binary logits, and
the loss Megatron-LM's pretrain_bert computes: masked-token mean of BertModel's per-token loss +
sentence-order cross-entropy) beside it; then load the directory `load_tp1` into a fresh model
with dist_checkpointing.load and write its state_dict and logits. Then at tensor parallel 2: load
`load_tp2` and write the (gathered) logits. Megatron-Core assumes CUDA where it does not change
the math (a device sync, the CUDA RNG tracker around dropout, which eval does not use): stubbed.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron_cpu import init_cpu_process_group


def build(spec: dict, rows: int, tp: int):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
                            num_attention_heads=spec["num_heads"], ffn_hidden_size=spec["ffn_hidden_size"],
                            tensor_model_parallel_size=tp,
                            layernorm_epsilon=spec["norm_eps"], use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    return BertModel(cfg, num_tokentypes=spec["num_token_types"], transformer_layer_spec=bert_layer_local_spec,
                     vocab_size=rows, max_sequence_length=spec["max_seq_len"], parallel_output=False,
                     share_embeddings_and_output_weights=spec["tied"], add_binary_head=spec["binary_head"]).eval()


def forward(model, inputs: dict, spec: dict) -> dict:
    """Megatron's outputs: logits [b, s, rows], binary logits [b, 2], and pretrain_bert's loss."""
    types = inputs["token_types"] if spec["num_token_types"] else None
    with torch.no_grad():
        logits, binary = model(inputs["tokens"], inputs["attention_mask"], tokentype_ids=types)
        out = {"logits": logits, "binary_logits": binary}
        if model.config.tensor_model_parallel_size == 1:
            masked = inputs["labels"] >= 0  # Megatron's loss_mask
            per_token, _ = model(inputs["tokens"], inputs["attention_mask"], tokentype_ids=types,
                                 lm_labels=inputs["labels"].clamp(min=0))
            loss = (per_token * masked).sum() / masked.sum()
            if binary is not None:
                loss = loss + F.cross_entropy(binary.float(), inputs["binary_labels"])
            out["loss"] = loss
    return out


def randomize(model) -> None:
    """Every tensor informative: no constant norms or zero biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name and p.ndim == 1
            p.copy_(torch.randn_like(p) * (0.1 if norm or p.ndim == 1 else 0.2) + (1.0 if norm else 0.0))


def tensors(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def main() -> None:
    work = json.loads(open(sys.argv[1]).read())
    init_cpu_process_group()
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

    rank0 = dist.get_rank() == 0
    for tp in (1, dist.get_world_size()):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, 1)
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        for case in work["cases"]:
            spec, inputs = case["spec"], torch.load(case["inputs"], weights_only=True)
            rows = spec["vocab_size"] if tp == 1 else spec["rows_tp2"]
            if tp == 1:  # Megatron's own checkpoint and outputs
                torch.manual_seed(spec["seed"])
                model = build(spec, rows, tp)
                randomize(model)
                dist_checkpointing.save(model.sharded_state_dict(), case["save"])
                out = forward(model, inputs, spec)
                if rank0:
                    torch.save({**out, "params": tensors(model)}, os.path.join(case["save"], "..", "reference.pt"))
            model = build(spec, rows, tp)
            load = case["load_tp1"] if tp == 1 else case["load_tp2"]
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load))
            out = forward(model, inputs, spec)  # every rank: at tensor parallel 2 its layers communicate
            if rank0:
                torch.save({**out, "params": tensors(model)} if tp == 1 else out,
                           os.path.join(load, "..", f"megatron_tp{tp}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
