#include "learner/distributed.h"

#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#ifdef ODYSSEY_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace odyssey::learner {

#ifdef ODYSSEY_WITH_CUDA
using BackendGroup = c10d::ProcessGroupNCCL;
#else
using BackendGroup = c10d::ProcessGroupGloo;
#endif

struct DataParallel::Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<BackendGroup> pg;
  at::Device device = at::kCPU;
};

DataParallel::DataParallel(const DataParallelOptions& options) : options_(options) {}

DataParallel::~DataParallel() {
#ifdef ODYSSEY_WITH_CUDA
  if (group_ && group_->pg) group_->pg->shutdown();
#endif
}

Result<std::unique_ptr<DataParallel>> DataParallel::create(const DataParallelOptions& o) {
  if (o.ranks < 1 || o.rank < 0 || o.rank >= o.ranks)
    return invalid_argument("learner: rank {} is outside [0, learner.ranks = {})", o.rank, o.ranks);
  std::unique_ptr<DataParallel> dp(new DataParallel(o));
  if (o.ranks == 1) return dp;
#ifdef ODYSSEY_WITH_CUDA
  if (o.backend != "nccl")
    return invalid_argument("learner.backend '{}': the GPU build runs data parallel over nccl", o.backend);
#else
  if (o.backend != "gloo")
    return invalid_argument("learner.backend '{}': this build has no CUDA; use gloo", o.backend);
#endif
  const auto colon = o.master.rfind(':');
  if (colon == std::string::npos || colon == 0)
    return invalid_argument("learner.master '{}' must be host:port", o.master);
  const std::string host = o.master.substr(0, colon);
  int port = 0;
  try {
    port = std::stoi(o.master.substr(colon + 1));
  } catch (const std::exception&) {
    port = -1;
  }
  if (port <= 0 || port > 65535) return invalid_argument("learner.master '{}': bad port", o.master);
  try {
    auto group = std::make_unique<Group>();
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = o.rank == 0;
    so.numWorkers = static_cast<size_t>(o.ranks);
    so.waitWorkers = true;
    so.timeout = o.timeout;
    group->store = c10::make_intrusive<c10d::TCPStore>(host, so);
#ifdef ODYSSEY_WITH_CUDA
    group->device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(c10::cuda::current_device()));
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = o.timeout;
    group->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(group->store, o.rank, o.ranks, opts);
#else
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->timeout = o.timeout;
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
    group->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(group->store, o.rank, o.ranks, opts);
#endif
    dp->group_ = std::move(group);
  } catch (const std::exception& e) {
    return make_status(StatusCode::kUnavailable, "learner rank {} of {}: c10d {} rendezvous at {} failed: {}", o.rank,
                       o.ranks, o.backend, o.master, e.what());
  }
  spdlog::info("learner rank {} of {}: c10d {} group up (store {})", o.rank, o.ranks, o.backend, o.master);
  return dp;
}

void DataParallel::all_reduce(at::Tensor& tensor, bool max) {
  if (!group_) return;
  std::vector<at::Tensor> t{tensor.to(group_->device).contiguous()};
  c10d::AllreduceOptions opts;
  opts.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  group_->pg->allreduce(t, opts)->wait();
  if (!t[0].is_same(tensor)) tensor.copy_(t[0]);
}

void DataParallel::all_reduce_sum(at::Tensor& tensor) { all_reduce(tensor, /*max=*/false); }
void DataParallel::all_reduce_max(at::Tensor& tensor) { all_reduce(tensor, /*max=*/true); }

void DataParallel::broadcast(at::Tensor& tensor, int root) {
  if (!group_) return;
  std::vector<at::Tensor> t{tensor.to(group_->device).contiguous()};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  group_->pg->broadcast(t, opts)->wait();
  if (!t[0].is_same(tensor)) {
    tensor.copy_(t[0]);
  } else {
    // The collective wrote the tensor's memory behind LibTorch's back: bump its version as an
    // in-place op would, so that what keys on it (model::Bf16Shadow) sees the new values.
    tensor.unsafeGetTensorImpl()->bump_version();
  }
}

void DataParallel::barrier() {
  at::Tensor t = at::zeros({1});
  all_reduce_sum(t);
}

}  // namespace odyssey::learner
