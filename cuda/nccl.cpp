// NCCL through dlopen (see nccl.h). The declarations below are NCCL 2.x's C ABI (nccl.h of 2.x): an
// opaque communicator pointer, a 128-byte unique id passed by value, int enums.
#include "nccl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <type_traits>

#include "check.h"
#include "core/error.h"
#include "runtime.h"

namespace tallow::cuda {

namespace {

constexpr int kUniqueIdBytes = 128;
struct UniqueId { char internal[kUniqueIdBytes]; };
using Result = int;                 // ncclResult_t: 0 ncclSuccess, 7 ncclInProgress
constexpr int kSum = 0;             // ncclRedOp_t ncclSum
enum DataType : int { kInt8 = 0, kUint8 = 1, kInt32 = 2, kInt64 = 4, kFloat16 = 6, kFloat32 = 7, kBfloat16 = 9 };

struct Api {
  void* lib = nullptr;
  Result (*GetVersion)(int*) = nullptr;
  Result (*GetUniqueId)(UniqueId*) = nullptr;
  Result (*CommInitRank)(void**, int, UniqueId, int) = nullptr;
  Result (*CommDestroy)(void*) = nullptr;
  Result (*CommAbort)(void*) = nullptr;
  Result (*CommGetAsyncError)(void*, Result*) = nullptr;
  const char* (*GetErrorString)(Result) = nullptr;
  Result (*AllReduce)(const void*, void*, size_t, int, int, void*, cudaStream_t) = nullptr;
  Result (*AllGather)(const void*, void*, size_t, int, void*, cudaStream_t) = nullptr;
  Result (*Broadcast)(const void*, void*, size_t, int, int, void*, cudaStream_t) = nullptr;
};

Api g_api;
std::mutex g_mu;

const Api& api() {
  if (!g_api.lib) throw std::runtime_error("NCCL is not loaded (tallow.parallel.nccl_communicator loads it)");
  return g_api;
}

void check(const char* op, Result r) {
  if (r == 0) return;
  const char* msg = g_api.GetErrorString ? g_api.GetErrorString(r) : "unknown";
  throw std::runtime_error(str_cat("nccl ", op, ": ", msg, " (ncclResult_t ", r, ")"));
}

int nccl_dtype(DType d) {
  switch (d) {
    case DType::F32: return kFloat32;
    case DType::F16: return kFloat16;
    case DType::BF16: return kBfloat16;
    case DType::I32: return kInt32;
    case DType::I64: return kInt64;
    case DType::I8: return kInt8;
    case DType::U8: case DType::Bool: case DType::F8E4M3: return kUint8;
    default: return -1;
  }
}

}  // namespace

void nccl_load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api.lib) return;
  const std::string name = path.empty() ? "libnccl.so.2" : path;
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) throw std::runtime_error(str_cat("nccl_load: cannot open ", name, ": ", dlerror()));
  Api a;
  a.lib = lib;
  auto sym = [&](auto& fn, const char* s) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, s));
    if (!fn) {
      dlclose(lib);
      throw std::runtime_error(str_cat("nccl_load: ", name, " has no ", s, " (not NCCL 2.x?)"));
    }
  };
  sym(a.GetVersion, "ncclGetVersion");
  sym(a.GetUniqueId, "ncclGetUniqueId");
  sym(a.CommInitRank, "ncclCommInitRank");
  sym(a.CommDestroy, "ncclCommDestroy");
  sym(a.CommAbort, "ncclCommAbort");
  sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
  sym(a.GetErrorString, "ncclGetErrorString");
  sym(a.AllReduce, "ncclAllReduce");
  sym(a.AllGather, "ncclAllGather");
  sym(a.Broadcast, "ncclBroadcast");
  int v = 0;
  if (a.GetVersion(&v) != 0 || v < 20900) {  // graph capture of collectives needs 2.9.6+
    dlclose(lib);
    throw std::runtime_error(str_cat("nccl_load: ", name, " is NCCL version code ", v, "; tallow needs 2.9 or newer"));
  }
  g_api = a;
}

bool nccl_loaded() { return g_api.lib != nullptr; }

int nccl_version() {
  int v = 0;
  check("get_version", api().GetVersion(&v));
  return v;
}

std::string nccl_unique_id() {
  UniqueId id;
  check("get_unique_id", api().GetUniqueId(&id));
  return std::string(id.internal, kUniqueIdBytes);
}

NcclComm::NcclComm(const std::string& unique_id, int world_size, int rank, int device)
    : world_(world_size), rank_(rank), device_(device) {
  TALLOW_CHECK(unique_id.size() == kUniqueIdBytes, "NcclComm: the unique id must be ", kUniqueIdBytes,
               " bytes, got ", unique_id.size());
  TALLOW_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "NcclComm: rank ", rank, " of world size ",
               world_size);
  const Api& a = api();
  UniqueId id;
  std::memcpy(id.internal, unique_id.data(), kUniqueIdBytes);
  DeviceGuard g(device);
  check("comm_init_rank", a.CommInitRank(&comm_, world_size, id, rank));
}

NcclComm::~NcclComm() {
  if (!comm_) return;
  DeviceGuard g(device_);
  if (aborted_) return;  // ncclCommAbort freed it
  (void)g_api.CommDestroy(comm_);
}

void NcclComm::check_tensor(const char* op, const Tensor& t) const {
  TALLOW_CHECK(!aborted_, "nccl ", op, ": the communicator was aborted");
  TALLOW_CHECK(t.device().type == DeviceType::CUDA && t.device().index == device_, "nccl ", op,
               ": tensor on ", t.device().str(), ", communicator on cuda:", device_);
  TALLOW_CHECK(t.is_contiguous(), "nccl ", op, ": tensor of shape ", shape_str(t.shape()), " is not contiguous");
  TALLOW_CHECK(nccl_dtype(t.dtype()) >= 0, "nccl ", op, ": dtype ", dtype_name(t.dtype()), " is not supported");
}

void NcclComm::all_reduce(const Tensor& t) {
  check_tensor("all_reduce", t);
  TALLOW_CHECK(t.dtype() != DType::F8E4M3 && t.dtype() != DType::Bool, "nccl all_reduce: cannot sum ",
               dtype_name(t.dtype()));
  DeviceGuard g(device_);
  check("all_reduce", api().AllReduce(t.data_ptr(), t.data_ptr(), (size_t)t.numel(), nccl_dtype(t.dtype()), kSum,
                                       comm_, (cudaStream_t)current_stream(device_)));
}

void NcclComm::all_gather(const Tensor& out, const Tensor& in) {
  check_tensor("all_gather", in);
  check_tensor("all_gather", out);
  TALLOW_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() * world_, "nccl all_gather: output ",
               shape_str(out.shape()), " ", dtype_name(out.dtype()), " for ", world_, " x input ",
               shape_str(in.shape()), " ", dtype_name(in.dtype()));
  DeviceGuard g(device_);
  check("all_gather", api().AllGather(in.data_ptr(), out.data_ptr(), (size_t)in.numel(), nccl_dtype(in.dtype()),
                                       comm_, (cudaStream_t)current_stream(device_)));
}

void NcclComm::broadcast(const Tensor& t, int root) {
  check_tensor("broadcast", t);
  TALLOW_CHECK(root >= 0 && root < world_, "nccl broadcast: root ", root, " of world size ", world_);
  DeviceGuard g(device_);
  check("broadcast", api().Broadcast(t.data_ptr(), t.data_ptr(), (size_t)t.numel(), nccl_dtype(t.dtype()), root,
                                      comm_, (cudaStream_t)current_stream(device_)));
}

std::string NcclComm::async_error() {
  if (aborted_) return "aborted";
  Result r = 0;
  check("get_async_error", api().CommGetAsyncError(comm_, &r));
  return (r == 0 || r == 7) ? std::string() : std::string(g_api.GetErrorString(r));
}

void NcclComm::abort() {
  if (aborted_ || !comm_) return;
  aborted_ = true;
  DeviceGuard g(device_);
  (void)api().CommAbort(comm_);
}

}  // namespace tallow::cuda
