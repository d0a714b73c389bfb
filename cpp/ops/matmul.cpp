// matmul and linear: argument checks and shape/stride bookkeeping; the GEMM itself is in gemm_kernel.h.
#include "ops/matmul.h"

#include <vector>

#include "ops/common.h"
#include "ops/gemm_kernel.h"

namespace tallow::ops {

namespace {

gemm::Elt elt_of(DType t) {
  switch (t) {
    case DType::F16: return gemm::Elt::F16;
    case DType::BF16: return gemm::Elt::BF16;
    default: return gemm::Elt::F32;
  }
}

void check_not_quantized(const char* op, const Tensor& t, const char* name) {
  TALLOW_CHECK_TYPE(!is_block_dtype(t.dtype()), op, ": ", name, " is ", dtype_name(t.dtype()), " of shape ",
                    shape_str(t.shape()), "; quantized GEMMs are not supported yet (dequantize it to a float dtype "
                    "first, e.g. w.to('bfloat16'))");
}

// Stride that steps through dims [0, d1] of t as one flattened index, or 0 when they cannot be merged.
// Size-1 dims never matter; a merged dim of size n at stride s must sit at n*s above the next.
bool merged_stride(const Tensor& t, int64_t last, int64_t* stride) {
  int64_t s = t.stride(last), span = t.size(last);
  for (int64_t d = last - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (span == 1) {
      s = t.stride(d), span = t.size(d);
      continue;
    }
    if (t.stride(d) != s * span) return false;
    span *= t.size(d);
  }
  *stride = s;
  return true;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  const char* op = "matmul";
  check_defined(op, a, "a");
  check_defined(op, b, "b");
  check_not_quantized(op, a, "a");
  check_not_quantized(op, b, "b");
  check_float(op, a, "a");
  check_same_dtype(op, a, "a", b, "b");
  check_same_device(op, a, b);
  TALLOW_CHECK(a.dim() >= 2 && b.dim() >= 2, op, ": a ", shape_str(a.shape()), " and b ", shape_str(b.shape()),
               " must both be at least 2-D ([..., M, K] @ [..., K, N])");
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  TALLOW_CHECK(b.size(-2) == K, op, ": a ", shape_str(a.shape()), " and b ", shape_str(b.shape()),
               ": inner dimensions differ (a.shape[-1] = ", K, ", b.shape[-2] = ", b.size(-2), ")");
  // Batch dims broadcast as in numpy.
  const Shape ab(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  const size_t nb = std::max(ab.size(), bb.size());
  Shape batch(nb);
  for (size_t i = 0; i < nb; ++i) {
    const int64_t da = i + ab.size() >= nb ? ab[i + ab.size() - nb] : 1;
    const int64_t db = i + bb.size() >= nb ? bb[i + bb.size() - nb] : 1;
    TALLOW_CHECK(da == db || da == 1 || db == 1, op, ": batch dimensions of a ", shape_str(a.shape()), " and b ",
                 shape_str(b.shape()), " cannot be broadcast together");
    batch[i] = da == 1 ? db : da;
  }
  Shape oshape = batch;
  oshape.push_back(M);
  oshape.push_back(N);
  if (!a.device().is_cpu()) {  // the entry first: no memory is touched on a device without the op
    const auto kernel = device_op(&BackendOps::matmul, op, a, {&a, &b});
    return kernel(a, b, make_out(op, out, oshape, a.dtype(), a.device()));
  }
  Tensor o = make_out(op, out, oshape, a.dtype(), a.device());
  if (o.numel() == 0) return o;

  Shape sa = batch, sb = batch;
  sa.push_back(M), sa.push_back(K);
  sb.push_back(K), sb.push_back(N);
  const Tensor ea = a.expand(sa), eb = b.expand(sb);
  const int64_t nbatch = shape_numel(batch);

  gemm::Problem p;
  p.M = M, p.N = N, p.K = K;
  p.a = a.data_ptr(), p.rsa = ea.stride(-2), p.csa = ea.stride(-1);
  p.b = b.data_ptr(), p.rsb = eb.stride(-2), p.csb = eb.stride(-1);
  p.c = o.data_ptr(), p.rsc = N, p.csc = 1;

  bool b_shared = true;
  for (size_t d = 0; d < nb; ++d) b_shared = b_shared && (eb.stride((int64_t)d) == 0 || batch[d] == 1);
  int64_t rs = 0;
  std::vector<int64_t> aoff, boff, coff;
  if (nbatch > 1 && b_shared && merged_stride(ea, (int64_t)nb, &rs)) {
    // b is the same matrix for every batch and a's batch rows are evenly spaced: one tall GEMM.
    p.M = nbatch * M;
    p.rsa = rs;
  } else if (nbatch > 1) {
    aoff.resize(nbatch), boff.resize(nbatch), coff.resize(nbatch);
    for (int64_t i = 0; i < nbatch; ++i) {
      int64_t r = i, oa = 0, ob = 0;
      for (int64_t d = (int64_t)nb - 1; d >= 0; --d) {
        const int64_t idx = r % batch[d];
        r /= batch[d];
        oa += idx * ea.stride(d);
        ob += idx * eb.stride(d);
      }
      aoff[i] = oa, boff[i] = ob, coff[i] = i * M * N;
    }
    p.batch = nbatch;
    p.aoff = aoff.data(), p.boff = boff.data(), p.coff = coff.data();
  }
  gemm::run(elt_of(a.dtype()), p);
  return o;
}

Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::optional<Tensor>& out) {
  const char* op = "linear";
  check_defined(op, x, "x");
  check_defined(op, w, "w");
  check_not_quantized(op, w, "w");
  check_not_quantized(op, x, "x");
  check_float(op, x, "x");
  check_same_dtype(op, x, "x", w, "w");
  check_same_device(op, x, w);
  TALLOW_CHECK(w.dim() == 2, op, ": w must be 2-D [N, K], got shape ", shape_str(w.shape()), " (x ",
               shape_str(x.shape()), ")");
  TALLOW_CHECK(x.dim() >= 1, op, ": x must be at least 1-D [..., K], got shape ", shape_str(x.shape()));
  const int64_t N = w.size(0), K = w.size(1);
  TALLOW_CHECK(x.size(-1) == K, op, ": x ", shape_str(x.shape()), " and w ", shape_str(w.shape()),
               ": x.shape[-1] = ", x.size(-1), " must equal w.shape[1] = ", K);
  const bool has_bias = bias && bias->defined();
  if (has_bias) {
    check_same_dtype(op, x, "x", *bias, "bias");
    check_same_device(op, x, *bias);
    TALLOW_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [", N, "] for w ",
                 shape_str(w.shape()), ", got ", shape_str(bias->shape()));
  }
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  oshape.push_back(N);
  if (!x.device().is_cpu()) {
    const auto kernel = device_op(&BackendOps::linear, op, x, {&x, &w});
    return kernel(x, w, bias, make_out(op, out, oshape, x.dtype(), x.device()));
  }
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  if (o.numel() == 0) return o;

  const int64_t M = o.numel() / N;
  Tensor xx = x;
  int64_t rsa = K;
  if (x.dim() >= 2 && !merged_stride(x, x.dim() - 2, &rsa)) {
    xx = x.contiguous();
    rsa = K;
  }
  gemm::Problem p;
  p.M = M, p.N = N, p.K = K;
  p.a = xx.data_ptr(), p.rsa = rsa, p.csa = xx.stride(-1);
  p.b = w.data_ptr(), p.rsb = w.stride(1), p.csb = w.stride(0);  // B[k, n] = w[n, k]
  p.c = o.data_ptr(), p.rsc = N, p.csc = 1;
  if (has_bias) p.bias = bias->data_ptr(), p.bias_mode = 1, p.bias_stride = bias->stride(0);
  gemm::run(elt_of(x.dtype()), p);
  return o;
}

}  // namespace tallow::ops
