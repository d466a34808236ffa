"""Decode steps fused into one op: a quantized Mamba1 mixer's SSM side (mixer_step.py,
``qmixer_ssm_step``; Triton: mixer_step_triton.py, CUDA: mixer_step_cuda.py), a W8A8 or W4A8
block's whole step (layer_step.py, ``qmamba_layer_step``; CUDA: layer_step_cuda.py) and a W4A16
mixer's SSM side and whole block (w4a16_step.py; CUDA: w4a16_step_cuda.py, w4a16_layer_cuda.py).
Each reference is the chain of single ops it fuses; the weight records they share are in
weights.py. The launchers are imported where a step may run them, not registered up front."""
