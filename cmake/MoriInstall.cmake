# `cmake --install`: libmori with the programs and plugins that sit next to it, the public headers
# (cmake/MoriPublicHeaders.cmake) and a CMake package, so that a C++ project builds against mori
# with
#     find_package(mori CONFIG REQUIRED)
#     target_link_libraries(engine PRIVATE mori::mori)
# (cmake/moriConfig.cmake.in says what the package provides). Included at the end of
# src/CMakeLists.txt, once every installed target exists. Wheels (scikit-build-core) install only
# the `python` component (src/pybind/CMakeLists.txt); nothing here is part of it.
#
# Layout under the prefix (lib is CMAKE_INSTALL_LIBDIR):
#   include/mori/...                     the public headers
#   lib/libmori.so                       the library
#   lib/mori-emulated-nic                the emulated NIC (MORI_RDMA_EMULATE), found next to libmori
#   lib/libmori_mpi_bootstrap.so         the MPI bootstrap plugin (when MPI was found), likewise
#   lib/cmake/mori/                      moriConfig.cmake, moriConfigVersion.cmake, the targets

include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
include("${CMAKE_CURRENT_LIST_DIR}/MoriPublicHeaders.cmake")

if(SKBUILD)
  return()
endif()

set(MORI_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/mori" CACHE STRING
    "Where `cmake --install` puts mori's CMake package (relative to the prefix)")

# mori::mori and mori::gpu_runtime (the GPU runtime with the backend definition; mori::mori
# links it). libmori finds the GPU runtime it was linked with through its RPATH.
set_target_properties(mori_gpu_runtime PROPERTIES EXPORT_NAME gpu_runtime)
set_target_properties(mori PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS mori mori_gpu_runtime EXPORT moriTargets
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")

# Programs and plugins libmori looks for in its own directory.
set_target_properties(mori-emulated-nic PROPERTIES EXPORT_NAME emulated_nic)
install(TARGETS mori-emulated-nic EXPORT moriTargets RUNTIME DESTINATION "${CMAKE_INSTALL_LIBDIR}")
install(EXPORT moriTargets NAMESPACE mori:: DESTINATION "${MORI_INSTALL_CMAKEDIR}"
        FILE moriTargets.cmake)
# The MPI bootstrap plugin, a module libmori dlopens (nothing links it): a target of its own,
# mori::mpi_bootstrap, in a file of its own, present only when MPI was found.
if(TARGET mori_mpi_bootstrap)
  set_target_properties(mori_mpi_bootstrap PROPERTIES EXPORT_NAME mpi_bootstrap)
  install(TARGETS mori_mpi_bootstrap EXPORT moriMpiBootstrapTargets
          LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}")
  install(EXPORT moriMpiBootstrapTargets NAMESPACE mori:: DESTINATION "${MORI_INSTALL_CMAKEDIR}"
          FILE moriMpiBootstrapTargets.cmake)
endif()

foreach(_h IN LISTS MORI_PUBLIC_HEADERS)
  get_filename_component(_d "${_h}" DIRECTORY)
  install(FILES "${PROJECT_SOURCE_DIR}/include/${_h}"
          DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${_d}")
endforeach()

# The package: config (with what the build decided: backend, architectures, the HIP prefix),
# version, and mori_add_gpu_sources().
set(MORI_CONFIG_GPU_LANG "${MORI_GPU_LANG}")
set(MORI_CONFIG_GPU_ARCHS "${MORI_GPU_ARCHS_RESOLVED}")
set(MORI_CONFIG_HIP_PREFIX "${_mori_rocm_prefix}")
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/moriConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/package/moriConfig.cmake"
                              INSTALL_DESTINATION "${MORI_INSTALL_CMAKEDIR}")
# 0.x: a minor release may change the API; patch releases keep it.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/package/moriConfigVersion.cmake"
                                 VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/package/moriConfig.cmake"
              "${PROJECT_BINARY_DIR}/package/moriConfigVersion.cmake"
        DESTINATION "${MORI_INSTALL_CMAKEDIR}")
install(FILES "${CMAKE_CURRENT_LIST_DIR}/MoriTargets.cmake" DESTINATION "${MORI_INSTALL_CMAKEDIR}"
        RENAME moriGpuSources.cmake)
