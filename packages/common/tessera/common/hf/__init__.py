"""Hugging Face plumbing shared by every model kind (each kind's own mapping is its adapter, e.g.
tessera.common.models.causal_lm.hf, found through tessera.common.models.registry).

- `architecture`: what one architecture provides, and the typed config.json reader.
- `rules`: tensor mapping rules and the validation of weights against them.
- `directory`: reading an HF directory (config, safetensors weights zero-copy, EOS ids): the one
  reader, for import and serving.
- `generation`: a model's generation settings (generation_config.json's end ids and sampling
  defaults), carried by checkpoints and exports and applied by the server.
"""
