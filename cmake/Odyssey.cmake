# Helpers shared by every folder's CMakeLists.

# Warnings for our own code.
function(odyssey_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()

# A library built from LibTorch headers shares one precompiled header, so the slow
# headers are parsed once per build instead of once per file.
function(odyssey_torch_pch target)
  if(ODYSSEY_PCH)
    if(TARGET odyssey_torch_pch_anchor)
      target_precompile_headers(${target} REUSE_FROM odyssey_torch_pch_anchor)
    else()
      target_precompile_headers(${target} PRIVATE <ATen/ATen.h> <torch/types.h>)
    endif()
  endif()
endfunction()
