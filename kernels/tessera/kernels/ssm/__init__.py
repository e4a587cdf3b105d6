"""Triton kernels for Mamba-2 (the SSD chunked scan, the causal conv1d, the decoding state
update). Imported only by the dispatchers in tessera.kernels.ssd / causal_conv1d, so CPU-only
installs never import Triton."""
