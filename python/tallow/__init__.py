"""tallow: serve and run large language models fast.

The C++ core lives in ``tallow._core`` (tensors and ops); nothing in the runtime imports torch.
"""
from pkgutil import extend_path

# A development build (cmake -S . -B build) places _core in build/python/tallow; with
# PYTHONPATH=build/python:python both halves of the package are found.
__path__ = extend_path(__path__, __name__)

from tallow._version import __version__  # noqa: E402
from tallow.cuda_libs import import_core  # noqa: E402

_core = import_core()  # a CUDA build may first need cuBLAS from the nvidia wheels (cuda_libs.py)
from tallow._core import (  # noqa: E402
    Device,
    DType,
    Tensor,
    empty,
    from_buffer,
    from_dlpack,
    from_numpy,
    get_num_threads,
    set_num_threads,
    tensor,
)
from tallow import ops  # noqa: E402
from tallow.engine.embedding_output import EmbeddingOutput, EmbeddingRequestOutput  # noqa: E402
from tallow.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tallow.engine.sampling_params import SamplingParams  # noqa: E402
from tallow.llm import LLM  # noqa: E402

float32 = DType.float32
float16 = DType.float16
bfloat16 = DType.bfloat16
float8_e4m3 = DType.float8_e4m3
int8 = DType.int8
uint8 = DType.uint8
int32 = DType.int32
int64 = DType.int64
bool_ = DType.bool

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput",
    "Device", "DType", "Tensor", "empty", "from_buffer", "from_dlpack", "from_numpy", "get_num_threads",
    "set_num_threads", "tensor", "ops", "float32", "float16", "bfloat16", "float8_e4m3", "int8", "uint8",
    "int32", "int64", "bool_", "__version__",
]
