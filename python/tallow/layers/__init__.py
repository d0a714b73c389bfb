"""Model building blocks shared by the model files: linear layers with their quantization methods
(linear.py, quantization/), attention, rotary, norms, the gated MLP, sparse MoE and the generic decoder."""
