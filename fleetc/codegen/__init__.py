"""Code generation for fused ops: kernel sources for the devices fleetc runs on (Triton for CUDA)."""
