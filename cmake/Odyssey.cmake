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

# Links LibTorch into an executable so that the C++ standard library still wins symbol lookup.
# PyTorch's wheel (2.11) ships a libtorch.so that exports its own copies of some libstdc++
# functions (std::filesystem::remove_all, permissions, ...) whose internal calls are not
# bound: when libtorch.so precedes libstdc++ in the executable's DT_NEEDED order, our calls
# land in those copies and crash on a null call. Naming libstdc++ first fixes the order.
function(odyssey_link_torch_first_stdcxx target)
  target_link_libraries(${target} PRIVATE stdc++)
  get_target_property(libs ${target} LINK_LIBRARIES)
  list(REMOVE_ITEM libs stdc++)
  set_property(TARGET ${target} PROPERTY LINK_LIBRARIES stdc++ ${libs})
endfunction()
