"""The hybrid kind: Mamba-2 layers beside attention, MLP and MoE in Megatron's pattern (Nemotron-H, Mamba2)."""
