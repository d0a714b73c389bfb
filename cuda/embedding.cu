// embedding on CUDA: out[r, :] = table[ids[r], :], converted through f32 to the output dtype; GGUF
// block tables are dequantized per element (dequant.cuh, bit-exact). Ids are checked on the device
// and the flag read back before returning (IndexError, as on the CPU); under graph capture the
// read-back is impossible, so an out-of-range id yields a zero row instead.
#include "dequant.cuh"
#include "embedding.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

__global__ void check_ids_kernel(const void* ids, bool i32, int64_t n, int64_t V, int* flag) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t id = load_id(ids, i32, i);
    if (id < 0 || id >= V) atomicMax(flag, 1);
  }
}

template <class S, class O>
__global__ void gather_kernel(const void* ids, bool i32, int64_t start, const S* __restrict__ table, int64_t s0,
                              int64_t s1, int64_t V, int64_t D, O* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / D, c = i % D;
    const int64_t id = load_id(ids, i32, r) - start;
    out[i] = (id < 0 || id >= V) ? from_float<O>(0.f) : from_float<O>(to_float(table[id * s0 + c * s1]));
  }
}

template <DType kT, class O>
__global__ void gather_block_kernel(const void* ids, bool i32, int64_t start, const uint8_t* __restrict__ table,
                                    int64_t row_bytes, int bs, int ts, int64_t V, int64_t D, O* __restrict__ out,
                                    int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / D, c = i % D;
    const int64_t id = load_id(ids, i32, r) - start;
    out[i] = (id < 0 || id >= V) ? from_float<O>(0.f)
                                 : from_float<O>(deq::element<kT>(table + id * row_bytes + (c / bs) * ts, (int)(c % bs)));
  }
}

template <class F>
void dispatch_float(const char* op, DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::F16: return f(__half{});
    case DType::BF16: return f(__nv_bfloat16{});
    default: throw TypeError(str_cat(op, ": unsupported dtype ", dtype_name(dt), " on CUDA"));
  }
}

}  // namespace

Tensor embedding(const Tensor& ids_in, const Tensor& table, std::optional<DType> out_dtype,
                 std::optional<int64_t> vocab_start) {
  const char* op = "embedding";
  const DType tdt = table.dtype();
  const bool block = is_block_dtype(tdt);
  const DType odt = out_dtype ? *out_dtype : (block ? DType::F32 : tdt);
  const int64_t V = table.size(0), D = table.size(1);
  OpContext ctx(table);
  const Tensor ids = contiguous(ids_in);
  const bool i32 = ids.dtype() == DType::I32;
  const int64_t nids = ids.numel();
  Shape oshape = ids.shape();
  oshape.push_back(D);
  Tensor out = Tensor::empty(oshape, odt, table.device());
  const int64_t start = vocab_start.value_or(0);  // a vocabulary slice: ids outside it give zero rows
  if (!vocab_start && nids > 0 && index_checks() && !is_capturing(ctx.stream)) {
    DeviceFlag flag(table, ctx.stream);
    check_ids_kernel<<<grid_for(nids, 256), 256, 0, ctx.stream>>>(ids.data_ptr(), i32, nids, V, flag.ptr());
    TALLOW_CUDA_CHECK_LAUNCH(op);
    TALLOW_CHECK_INDEX(flag.read() == 0, op, ": an id is out of range for a table of V = ", V, " rows");
  }
  const int64_t n = out.numel();
  if (n == 0) return out;
  const unsigned blocks = grid_for(n, 256);
  if (block) {
    const int bs = (int)dtype_block_size(tdt), ts = (int)dtype_type_size(tdt);
    const int64_t row_bytes = dtype_nbytes(tdt, D);
    const uint8_t* tb = static_cast<const uint8_t*>(table.data_ptr());
    dispatch_float(op, odt, [&](auto otag) {
      using O = decltype(otag);
      O* po = static_cast<O*>(out.data_ptr());
      switch (tdt) {
#define TALLOW_EMB_CASE(T)                                                                                        \
  case DType::T:                                                                                                  \
    gather_block_kernel<DType::T, O><<<blocks, 256, 0, ctx.stream>>>(ids.data_ptr(), i32, start, tb, row_bytes, bs, \
                                                                     ts, V, D, po, n);                            \
    break;
        TALLOW_FOR_EACH_BLOCK_DTYPE(TALLOW_EMB_CASE)
#undef TALLOW_EMB_CASE
        default: throw TypeError(str_cat(op, ": unsupported table dtype ", dtype_name(tdt)));
      }
    });
  } else {
    dispatch_float(op, tdt, [&](auto ttag) {
      using S = decltype(ttag);
      dispatch_float(op, odt, [&](auto otag) {
        using O = decltype(otag);
        gather_kernel<S, O><<<blocks, 256, 0, ctx.stream>>>(ids.data_ptr(), i32, start,
                                                            static_cast<const S*>(table.data_ptr()),
                                                            table.stride(0), table.stride(1), V, D,
                                                            static_cast<O*>(out.data_ptr()), n);
      });
    });
  }
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return out;
}

}  // namespace tallow::cuda
