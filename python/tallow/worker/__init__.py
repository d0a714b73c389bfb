"""The device side of the engine: a worker per device with its model runner (inputs, CUDA graphs,
the sampler), driven by plain-data steps from the engine's executor (engine/step_data.py)."""
