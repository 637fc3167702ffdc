# Finds every dependency the way that works on both machines (../shared/gpu/README.md):
# Debian 12 packages on the CPU machine, PyTorch's LibTorch + carried .debs on the GPU machine.
find_package(Threads REQUIRED)
find_package(Torch REQUIRED)                   # Debian libtorch-dev 1.13 / PyTorch 2.11 wheel
find_package(CapnProto CONFIG REQUIRED)
# Debian's CapnProtoConfig hard-codes /usr paths; where the packages are unpacked elsewhere
# (the GPU machine's /opt/deps) find the compiler and its standard imports on PATH instead.
if(NOT EXISTS "${CAPNP_EXECUTABLE}")
  find_program(CAPNP_EXECUTABLE_FOUND capnp REQUIRED)
  find_program(CAPNPC_CXX_EXECUTABLE_FOUND capnpc-c++ REQUIRED)
  find_path(CAPNP_INCLUDE_DIRECTORY_FOUND capnp/c++.capnp REQUIRED)
  set(CAPNP_EXECUTABLE ${CAPNP_EXECUTABLE_FOUND})
  set(CAPNPC_CXX_EXECUTABLE ${CAPNPC_CXX_EXECUTABLE_FOUND})
  set(CAPNP_INCLUDE_DIRECTORY ${CAPNP_INCLUDE_DIRECTORY_FOUND})
endif()
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)
find_package(tomlplusplus REQUIRED)

# RocksDB's own CMake config wants gflags/zstd/lz4 dev packages the GPU machine lacks.
find_path(ROCKSDB_INCLUDE_DIR rocksdb/db.h REQUIRED)
find_library(ROCKSDB_LIBRARY rocksdb REQUIRED)
add_library(odyssey_rocksdb INTERFACE)
target_include_directories(odyssey_rocksdb SYSTEM INTERFACE ${ROCKSDB_INCLUDE_DIR})
target_link_libraries(odyssey_rocksdb INTERFACE ${ROCKSDB_LIBRARY})

find_path(ZMQ_INCLUDE_DIR zmq.hpp REQUIRED)      # cppzmq header
find_library(ZMQ_LIBRARY zmq REQUIRED)
add_library(odyssey_zmq INTERFACE)
target_include_directories(odyssey_zmq SYSTEM INTERFACE ${ZMQ_INCLUDE_DIR})
target_link_libraries(odyssey_zmq INTERFACE ${ZMQ_LIBRARY})

find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)  # used header-only (XXH_INLINE_ALL)

if(ODYSSEY_TESTS)
  find_package(GTest REQUIRED)
endif()

if(ODYSSEY_CUDA)
  enable_language(CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS $ENV{NCCL_INCLUDE_DIR} REQUIRED)
else()
  find_path(GLOO_INCLUDE_DIR gloo/rendezvous/store.h)  # Debian libgloo-dev, for c10d Gloo
endif()
