// `odyssey doctor`: checks LibTorch, CUDA, c10d, RocksDB and ZeroMQ on this machine for real,
// prints one line per check and returns 0 only if every check passed.
#pragma once

namespace odyssey::cli {

int run_doctor();

}  // namespace odyssey::cli
