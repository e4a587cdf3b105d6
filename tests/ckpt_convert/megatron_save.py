"""Write a Megatron-Core torch_dist checkpoint with megatron-core's own code on CPU, and its logits.

Run as `python megatron_save.py save|load SPEC.json OUT_DIR [SPEC.json OUT_DIR ...]` (several models in
one process: megatron-core's import is most of the time): builds GPTModel (local, non-TE layer spec)
in a one-process gloo group, saves it with dist_checkpointing.save, and writes OUT_DIR/../reference.pt
with input tokens and Megatron's logits (with `load`: loads OUT_DIR with dist_checkpointing.load
instead, and writes OUT_DIR/../loaded.pt). Megatron-Core assumes CUDA in three places that do not
change the math (a device sync and the device of a failure flag in its checkpoint writer, the CUDA
RNG tracker around attention dropout, which eval does not use); they are stubbed for CPU.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from megatron_cpu import init_cpu_process_group


def run(spec: dict, out: str, loading: bool) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(spec.get("seed", 0))
    cfg = TransformerConfig(num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
                            num_attention_heads=spec["num_heads"], num_query_groups=spec["num_kv_heads"],
                            ffn_hidden_size=spec["ffn_hidden_size"], use_cpu_initialization=True,
                            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            add_bias_linear=False, params_dtype=torch.float32, layernorm_epsilon=1e-5,
                            init_method_std=0.2)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=spec["rows"], max_sequence_length=spec["max_seq_len"],
                     position_embedding_type="rope", share_embeddings_and_output_weights=spec["tied"])
    with torch.no_grad():  # random norms, so a swapped norm shows in the logits
        for name, p in model.named_parameters():
            if "layer_norm" in name or "final_layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    if loading:  # read `out` (our export) into the model instead of saving it
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), out))
    else:
        dist_checkpointing.save(model.sharded_state_dict(), out)
    seq = 16
    tokens = torch.randint(0, spec["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(seq).unsqueeze(0).expand(2, seq),
                       attention_mask=torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None])
    name = "loaded.pt" if loading else "reference.pt"
    torch.save({"tokens": tokens, "logits": logits}, os.path.join(out, "..", name))


def main() -> None:
    loading, pairs = sys.argv[1] == "load", sys.argv[2:]
    init_cpu_process_group()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    for spec, out in zip(pairs[::2], pairs[1::2]):  # several models, one process: one megatron import
        run(json.loads(open(spec).read()), out, loading)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
