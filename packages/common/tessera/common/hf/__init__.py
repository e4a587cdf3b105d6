"""The one Hugging Face adapter: config.json and tensor-name mapping per architecture, both
directions, used by `tessera-ckpt import/export` and by the server loading an HF directory.

- `registry`: the supported architectures (add one there) and the mapping entry points.
- `architecture`: what an architecture provides, and the typed config.json reader.
- `llama`, `gpt2`: the architectures.
- `rules`: tensor mapping rules and the validation of weights against them.
- `directory`: reading an HF directory (config, safetensors weights zero-copy, EOS ids): the one
  reader, for import and serving.
"""

from tessera.common.hf.architecture import HEAD, HF_DTYPE_NAMES, HFArchitecture, HFConfig
from tessera.common.hf.directory import (
    CONFIG,
    GENERATION_CONFIG,
    SAFETENSORS,
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    SafetensorsFile,
    SafetensorsWeights,
    eos_token_ids,
    is_hf_directory,
    load_hf_weights,
    read_hf_config,
    weight_files,
)
from tessera.common.hf.rules import WEIGHT_DTYPES, Combine, Rule, WeightSource, check_import
from tessera.common.models.causal_lm.hf.adapter import (
    ARCHITECTURES,
    VOCAB_PARAMS,
    architecture_for,
    architecture_of,
    check_exportable,
    export_rules,
    hf_config,
    import_rules,
    model_config_from_hf,
)

__all__ = [
    "ARCHITECTURES", "CONFIG", "GENERATION_CONFIG", "HEAD", "HF_DTYPE_NAMES", "SAFETENSORS", "SAFETENSORS_DTYPES", "SAFETENSORS_INDEX", "VOCAB_PARAMS",
    "WEIGHT_DTYPES", "Combine", "HFArchitecture", "HFConfig", "Rule", "SafetensorsFile", "SafetensorsWeights", "WeightSource",
    "architecture_for", "architecture_of", "check_exportable", "check_import", "eos_token_ids", "export_rules",
    "hf_config", "import_rules", "is_hf_directory", "load_hf_weights", "model_config_from_hf", "read_hf_config",
    "weight_files",
]
