#include "ops/token_ids.h"

#include "core/error.h"
#include "ops/common.h"

namespace tallow::ops {

void fill_from_previous_(const Tensor& ids, const Tensor& previous) {
  TALLOW_CHECK(ids.dtype() == DType::I32 && previous.dtype() == DType::I32 && ids.dim() == 1 &&
                   previous.dim() == 1 && ids.is_contiguous() && previous.is_contiguous(),
               "fill_from_previous_: needs contiguous 1-D int32 ids and previous, got ids ", shape_str(ids.shape()),
               " ", dtype_name(ids.dtype()), " and previous ", shape_str(previous.shape()), " ",
               dtype_name(previous.dtype()));
  TALLOW_CHECK(ids.device() == previous.device(), "fill_from_previous_: ids on ", ids.device().str(),
               " but previous on ", previous.device().str());
  if (!ids.device().is_cpu())
    return device_op(&BackendOps::fill_from_previous_, "fill_from_previous_", ids, {&ids, &previous})(ids, previous);
  int32_t* p = static_cast<int32_t*>(ids.data_ptr());
  const int32_t* prev = static_cast<const int32_t*>(previous.data_ptr());
  const int64_t n = previous.numel();
  for (int64_t t = 0; t < ids.numel(); ++t) {
    if (p[t] >= 0) continue;
    const int64_t j = -(int64_t)p[t] - 1;
    TALLOW_CHECK_INDEX(j < n, "fill_from_previous_: row ", t, " refers to previous[", j, "] but previous has ",
                       n, " entries");
    p[t] = prev[j];
  }
}

}  // namespace tallow::ops
