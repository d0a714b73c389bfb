"""The demo model's file for scripts, and a short tour of the core (``python -m tallow.demo``): build
tensors, run a transformer block's ops, time a matmul.

    from tallow import LLM, SamplingParams
    from tallow.demo import demo_model_path

    llm = LLM(demo_model_path())  # SmolLM2-135M-Instruct, Q4_1 GGUF
    print(llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0))[0].outputs[0].text)
"""
import time

import numpy as np

import tallow
from tallow import ops
from tallow.server.demo_model import DemoModelError, demo_model_path  # noqa: F401 - the public helper

__all__ = ["demo_model_path", "DemoModelError", "main"]


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"tallow {tallow.__version__}  threads={tallow.get_num_threads()}  build={tallow._core.build_info}")
    x = tallow.tensor(rng.standard_normal((4, 512)), dtype="bfloat16")
    w = tallow.tensor(rng.standard_normal(512) * 0.1 + 1.0, dtype="bfloat16")
    h = ops.rms_norm(x, w, 1e-6)
    print("rms_norm:", h)
    a = tallow.tensor(rng.standard_normal((256, 1024)), dtype="float32")
    b = tallow.tensor(rng.standard_normal((1024, 1024)), dtype="float32")
    ops.linear(a, b)  # warm up
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        ops.linear(a, b)
    dt = (time.perf_counter() - t0) / reps
    print(f"linear 256x1024x1024 f32: {2 * 256 * 1024 * 1024 / dt / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
