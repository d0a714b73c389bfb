// Strided device copies: dims are collapsed where both views are contiguous across them, the inner
// run is moved in the widest access (16/8/4/2/1 bytes) that the addresses and strides allow.
#include <algorithm>
#include <vector>

#include "common.cuh"
#include "copy_kernels.cuh"

namespace tallow::cuda {

namespace {

struct CopyDesc {
  int ndim;
  int64_t size[kMaxDims];
  int64_t dst_stride[kMaxDims];
  int64_t src_stride[kMaxDims];
};

template <class U>
__global__ void strided_copy_kernel(char* __restrict__ dst, const char* __restrict__ src, CopyDesc d, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t rem = i, doff = 0, soff = 0;
    for (int k = d.ndim - 1; k >= 0; --k) {
      const int64_t idx = rem % d.size[k];
      rem /= d.size[k];
      doff += idx * d.dst_stride[k];
      soff += idx * d.src_stride[k];
    }
    reinterpret_cast<U*>(dst)[doff] = reinterpret_cast<const U*>(src)[soff];
  }
}

struct Dim {
  int64_t size, ds, ss;  // strides in bytes
};

}  // namespace

void strided_copy(const Tensor& dst, const Tensor& src, void* stream_) {
  const cudaStream_t stream = (cudaStream_t)stream_;
  const int64_t n = dst.numel();
  if (n == 0) return;
  const DType dt = dst.dtype();
  const int64_t bs = dtype_block_size(dt), es = dtype_type_size(dt);
  char* dp = static_cast<char*>(dst.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  // Units of one element (one block for block dtypes), strides in bytes; drop size-1 dims.
  std::vector<Dim> dims;
  for (int64_t i = 0; i < dst.dim(); ++i) {
    int64_t size = dst.size(i);
    int64_t ds = dst.stride(i), ss = src.stride(i);
    if (bs > 1) {
      if (i == dst.dim() - 1) {
        size /= bs;
        ds = ss = 1;
      } else {
        ds /= bs;
        ss /= bs;
      }
    }
    if (size == 1) continue;
    dims.push_back({size, ds * es, ss * es});
  }
  // Merge dim k into k-1 when both views step over it contiguously.
  std::vector<Dim> merged;
  for (const Dim& d : dims) {
    if (!merged.empty()) {
      Dim& o = merged.back();
      if (o.ds == d.ds * d.size && o.ss == d.ss * d.size) {
        o.size *= d.size;
        o.ds = d.ds;
        o.ss = d.ss;
        continue;
      }
    }
    merged.push_back(d);
  }
  if (merged.empty()) merged.push_back({1, es, es});
  // Contiguous inner run in both: treat it as bytes and pick the widest access.
  int64_t unit = es;
  Dim& inner = merged.back();
  if (inner.ds == es && inner.ss == es) {
    inner.size *= es;
    inner.ds = inner.ss = 1;
    unit = 1;
    for (int64_t v : {16, 8, 4, 2}) {
      bool ok = (uintptr_t)dp % v == 0 && (uintptr_t)sp % v == 0 && inner.size % v == 0;
      for (size_t k = 0; k + 1 < merged.size() && ok; ++k) ok = merged[k].ds % v == 0 && merged[k].ss % v == 0;
      if (ok) {
        unit = v;
        break;
      }
    }
    inner.size /= unit;
    inner.ds = inner.ss = unit;
  } else {
    bool ok = (es == 1 || es == 2 || es == 4 || es == 8 || es == 16) && (uintptr_t)dp % es == 0 &&
              (uintptr_t)sp % es == 0;
    TALLOW_CHECK(ok, "copy_: unsupported strided layout for ", dtype_name(dt), " (element of ", es, " bytes)");
  }
  TALLOW_CHECK((int)merged.size() <= kMaxDims, "copy_: more than ", kMaxDims, " non-mergeable dims in ",
               shape_str(dst.shape()));
  CopyDesc d{};
  d.ndim = (int)merged.size();
  int64_t total = 1;
  for (int k = 0; k < d.ndim; ++k) {
    d.size[k] = merged[k].size;
    d.dst_stride[k] = merged[k].ds / unit;
    d.src_stride[k] = merged[k].ss / unit;
    total *= d.size[k];
  }
  if (d.ndim == 1 && d.dst_stride[0] == 1 && d.src_stride[0] == 1) {
    TALLOW_CUDA_CHECK("copy_", cudaMemcpyAsync(dp, sp, (size_t)(total * unit), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const int threads = 256;
  const unsigned blocks = grid_for(total, threads);
  switch (unit) {
    case 1: strided_copy_kernel<uint8_t><<<blocks, threads, 0, stream>>>(dp, sp, d, total); break;
    case 2: strided_copy_kernel<uint16_t><<<blocks, threads, 0, stream>>>(dp, sp, d, total); break;
    case 4: strided_copy_kernel<uint32_t><<<blocks, threads, 0, stream>>>(dp, sp, d, total); break;
    case 8: strided_copy_kernel<uint2><<<blocks, threads, 0, stream>>>(dp, sp, d, total); break;
    default: strided_copy_kernel<uint4><<<blocks, threads, 0, stream>>>(dp, sp, d, total); break;
  }
  TALLOW_CUDA_CHECK_LAUNCH("copy_");
}

Tensor contiguous(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  OpContext ctx(t);
  strided_copy(out, t, ctx.stream);
  return out;
}

}  // namespace tallow::cuda
