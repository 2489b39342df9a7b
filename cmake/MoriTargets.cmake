# Helpers shared by the src/, tests/, examples/ and tools/ CMakeLists; installed with mori's CMake
# package as moriGpuSources.cmake (cmake/MoriInstall.cmake), where MORI_GPU_LANG comes from
# moriConfig.cmake.

# mori_add_gpu_sources(<target> <file>...): add .cpp files that hold device code or include the GPU
# runtime to <target>, compiled as ${MORI_GPU_LANG} (one source for CUDA and HIP).
function(mori_add_gpu_sources target)
  target_sources(${target} PRIVATE ${ARGN})
  set(abs)
  foreach(f IN LISTS ARGN)
    get_filename_component(p "${f}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND abs "${p}")
  endforeach()
  set_source_files_properties(${abs} TARGET_DIRECTORY ${target} PROPERTIES LANGUAGE ${MORI_GPU_LANG})
endfunction()
