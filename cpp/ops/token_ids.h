// Token ids the host does not know yet. With overlapped (asynchronous) scheduling the engine
// prepares step n+1 before step n's sampled tokens reach the host: a row whose token is one of those
// holds -(j + 1), "the token sampled for row j of the previous step", and this op puts in the id
// from the device-side buffer of the previous step's samples.
#pragma once
#include "core/tensor.h"

namespace tallow::ops {

// In place on ids (i32 [T], contiguous): ids[t] < 0 becomes previous[-ids[t] - 1] (previous: i32 [N]
// on the same device). A reference past N raises on the CPU; on CUDA it leaves the row's id at 0
// (the check would need a device read, and the engine never builds one).
void fill_from_previous_(const Tensor& ids, const Tensor& previous);

}  // namespace tallow::ops
