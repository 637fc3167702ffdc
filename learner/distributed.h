// The learner's data-parallel group: LibTorch's c10d process group (Gloo on CPUs, NCCL in the
// GPU build), rendezvous through a c10d TCPStore at `master` ("host:port") whose server is rank
// 0. No collective is written here: every reduction is c10d's.
//
// With one rank there is no process group and every collective returns its input unchanged.
// Tensors handed to collectives are moved to the group's device for the call and back (NCCL
// needs CUDA tensors; Gloo here reduces CPU tensors).
//
// Errors: create() returns kUnavailable when the rendezvous or the group cannot be set up
// within `timeout` (naming the master address and backend), kInvalidArgument for a bad rank,
// backend or address. A collective that fails later (a peer died) throws c10::Error from c10d;
// the learner lets it end the process (its ranks are restarted together and resume from the
// last checkpoint).
// Thread-safety: one thread per rank drives its group.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/status.h"

namespace odyssey::learner {

struct DataParallelOptions {
  int rank = 0;
  int ranks = 1;
  std::string backend = "gloo";      // gloo | nccl
  std::string master = "127.0.0.1:29500";
  // Longest a collective (or the rendezvous) may wait for the other ranks. Ranks meet every
  // sample_wait_ms while waiting for data, but one rank's forward/backward over a very long
  // trajectory can keep the others waiting that long.
  std::chrono::milliseconds timeout{std::chrono::minutes(60)};
};

class DataParallel {
 public:
  static Result<std::unique_ptr<DataParallel>> create(const DataParallelOptions& options);
  ~DataParallel();

  int rank() const { return options_.rank; }
  int ranks() const { return options_.ranks; }
  bool is_root() const { return options_.rank == 0; }

  // In place, every rank ends with the elementwise sum / max over ranks.
  void all_reduce_sum(at::Tensor& tensor);
  void all_reduce_max(at::Tensor& tensor);
  // In place, every rank ends with rank `root`'s values.
  void broadcast(at::Tensor& tensor, int root = 0);
  void barrier();

 private:
  struct Group;
  explicit DataParallel(const DataParallelOptions& options);
  void all_reduce(at::Tensor& tensor, bool max);

  DataParallelOptions options_;
  std::unique_ptr<Group> group_;
};

}  // namespace odyssey::learner
