// odyssey doctor: what this machine has, and whether each piece works, checked for real:
// LibTorch (a matmul), the BLAS behind LibTorch's CPU matmuls (fast enough?), CUDA (a matmul on every device), c10d (a 2-rank all-reduce over
// Gloo on CPUs, NCCL on GPUs), RocksDB (a durable write), ZeroMQ (a loopback round trip).
// Exits non-zero naming what failed. The first thing to run on a new machine.
// This file alone includes LibTorch, and nothing of odyssey's own (whose fmt may differ from
// the one PyTorch's wheel bundles), so it builds as its own object library.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/types.h>
#include <torch/version.h>
#ifdef ODYSSEY_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/cuda.h>
#else
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <capnp/common.h>
#include <rocksdb/db.h>
#include <rocksdb/version.h>
#include <dlfcn.h>
#include <unistd.h>
#include <zmq.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include "cli/doctor.h"

namespace odyssey::cli {

namespace {

namespace fs = std::filesystem;

#ifdef ODYSSEY_WITH_CUDA
int cuda_devices() { return static_cast<int>(torch::cuda::device_count()); }
#endif

// An all-reduce, one thread per rank, over a FileStore rendezvous: 2 Gloo ranks on the CPU,
// one NCCL rank per GPU (NCCL allows one rank per device).
std::string check_c10d() {
  const fs::path store_path = fs::temp_directory_path() / ("odyssey-doctor-store-" + std::to_string(::getpid()));
  fs::remove(store_path);
#ifdef ODYSSEY_WITH_CUDA
  const int world = std::max(1, cuda_devices());
#else
  const int world = 2;
#endif
  std::vector<float> got(world, 0);
  std::vector<std::thread> ranks;
  std::string error;
  for (int rank = 0; rank < world; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(store_path.string(), world);
#ifdef ODYSSEY_WITH_CUDA
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(rank));
        c10d::ProcessGroupNCCL group(store, rank, world);
        std::vector<at::Tensor> t{at::ones({4}, at::TensorOptions().device(at::Device(at::kCUDA, rank))) * (rank + 1)};
        group.allreduce(t)->wait();
        got[rank] = t[0][0].item<float>();
        group.shutdown();
        return;
#else
        auto opts = c10d::ProcessGroupGloo::Options::create();
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        c10d::ProcessGroupGloo group(store, rank, world, opts);
        std::vector<at::Tensor> t{at::ones({4}) * (rank + 1)};
#endif
        group.allreduce(t)->wait();
        got[rank] = t[0][0].item<float>();
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
  }
  for (auto& r : ranks) r.join();
  fs::remove(store_path);
  if (!error.empty()) return error;
  const float expect = world * (world + 1) / 2.0f;
  for (float v : got)
    if (v != expect) return "all-reduce gave " + std::to_string(v) + ", expected " + std::to_string(expect);
  return "";
}

std::string check_rocksdb() {
  const fs::path dir = fs::temp_directory_path() / ("odyssey-doctor-rocksdb-" + std::to_string(::getpid()));
  rocksdb::Options o;
  o.create_if_missing = true;
  rocksdb::DB* raw = nullptr;
  auto s = rocksdb::DB::Open(o, dir.string(), &raw);
  std::string error;
  if (s.ok()) {
    rocksdb::WriteOptions wo;
    wo.sync = true;
    s = raw->Put(wo, "k", "v");
    std::string v;
    if (s.ok()) s = raw->Get(rocksdb::ReadOptions(), "k", &v);
    if (s.ok() && v != "v") error = "read back the wrong value";
    delete raw;
  }
  fs::remove_all(dir);
  return s.ok() ? error : s.ToString();
}

// The library behind the BLAS symbols LibTorch's CPU matmuls call (libblas.so.3 is a Debian
// alternative: the reference BLAS that libtorch-dev pulls in, or OpenBLAS once installed).
std::string blas_library() {
  Dl_info info{};
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  if (sgemm == nullptr || dladdr(sgemm, &info) == 0 || info.dli_fname == nullptr) return "BLAS: unknown library";
  std::error_code ec;
  const fs::path real = fs::canonical(info.dli_fname, ec);
  return "BLAS " + (ec ? std::string(info.dli_fname) : real.string());
}

// One thread, a 512^3 fp32 matmul, best of 5: an optimized BLAS does tens of GFLOP/s, the
// reference BLAS a few, which makes every CPU training and decoding step several times slower.
double blas_gflops() {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor a = at::randn({512, 512}), b = at::randn({512, 512});
  double best = 1e9;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor c = at::mm(a, b);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  at::set_num_threads(threads);
  return 2.0 * 512 * 512 * 512 / best / 1e9;
}

std::string check_blas(double gflops) {
  // The reference BLAS measured 5.9 GFLOP/s here, OpenBLAS over ten times that.
  constexpr double kMinGflops = 12.0;
  if (gflops >= kMinGflops) return "";
  char line[320];
  std::snprintf(line, sizeof line,
                "%.1f GFLOP/s on one thread for a 512^3 fp32 matmul (< %.0f): a reference BLAS; install "
                "libopenblas0-openmp (./dev.sh does) for several times faster CPU steps",
                gflops, kMinGflops);
  return line;
}

std::string check_zmq() {
  zmq::context_t ctx(1);
  zmq::socket_t a(ctx, zmq::socket_type::pair), b(ctx, zmq::socket_type::pair);
  a.set(zmq::sockopt::linger, 0);
  b.set(zmq::sockopt::linger, 0);
  a.bind("tcp://127.0.0.1:*");
  b.connect(a.get(zmq::sockopt::last_endpoint));
  b.send(zmq::str_buffer("ping"), zmq::send_flags::none);
  zmq::message_t m;
  a.set(zmq::sockopt::rcvtimeo, 5000);
  if (!a.recv(m) || m.to_string() != "ping") return "no loopback round trip within 5 s";
  return "";
}

}  // namespace

int run_doctor() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each check's line shows even if a later one crashes
  int failures = 0;
  auto report = [&](const char* what, const std::string& detail, const std::function<std::string()>& check) {
    std::string error;
    try {
      error = check();
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::printf("%-8s %-44s %s\n", what, detail.c_str(), error.empty() ? "ok" : ("FAILED: " + error).c_str());
    failures += !error.empty();
  };
  report("libtorch", "LibTorch " + std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                         "." + std::to_string(TORCH_VERSION_PATCH),
         [] {
           auto a = at::ones({64, 64});
           float v = at::matmul(a, a)[0][0].item<float>();
           return v == 64.0f ? std::string() : "matmul gave " + std::to_string(v);
         });
  const double gflops = blas_gflops();
  char blas_detail[160];
  std::snprintf(blas_detail, sizeof blas_detail, "%s, %.0f GFLOP/s", blas_library().c_str(), gflops);
  report("blas", blas_detail, [gflops] { return check_blas(gflops); });
#ifdef ODYSSEY_WITH_CUDA
  const int devices = cuda_devices();
  report("cuda", std::to_string(devices) + " device(s)", [devices] {
    if (devices == 0) return std::string("built with CUDA but no device is visible");
    for (int d = 0; d < devices; ++d) {
      auto a = at::ones({256, 256}, at::TensorOptions().device(at::Device(at::kCUDA, d)).dtype(at::kBFloat16));
      float v = at::matmul(a, a)[0][0].item<float>();
      if (v != 256.0f) return "device " + std::to_string(d) + " matmul gave " + std::to_string(v);
    }
    return std::string();
  });
  report("c10d", "NCCL, one rank per GPU", check_c10d);
#else
  std::printf("%-8s %-44s %s\n", "cuda", "not built (configure with -DODYSSEY_CUDA=ON)", "-");
  report("c10d", "Gloo, 2 ranks on 127.0.0.1", check_c10d);
#endif
  report("rocksdb", "RocksDB " + std::to_string(ROCKSDB_MAJOR) + "." + std::to_string(ROCKSDB_MINOR) + "." +
                        std::to_string(ROCKSDB_PATCH),
         check_rocksdb);
  int zmaj, zmin, zpat;
  zmq_version(&zmaj, &zmin, &zpat);
  report("zeromq", "libzmq " + std::to_string(zmaj) + "." + std::to_string(zmin) + "." + std::to_string(zpat),
         check_zmq);
  std::printf("%-8s %-44s %s\n", "capnp",
              ("Cap'n Proto " + std::to_string(CAPNP_VERSION_MAJOR) + "." + std::to_string(CAPNP_VERSION_MINOR) + "." +
               std::to_string(CAPNP_VERSION_MICRO))
                  .c_str(),
              "ok");
  std::printf("%s\n", failures ? "doctor: some checks FAILED" : "doctor: all checks passed");
  return failures ? 1 : 0;
}

}  // namespace odyssey::cli
