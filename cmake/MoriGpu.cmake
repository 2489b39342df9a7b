# MoriGpu.cmake - GPU backend selection for mori (one source tree, CUDA or HIP).
#
# Inputs (cache variables set by the top-level CMakeLists.txt before including this file):
#   MORI_GPU_BACKEND  CUDA | HIP | AUTO   (AUTO: nvcc found -> CUDA, else a HIP toolchain -> HIP)
#   MORI_GPU_ARCHS    e.g. "90" or "gfx90a;gfx942"; empty -> CMAKE_<LANG>_ARCHITECTURES if the
#                     user set it, else 90 (CUDA) / gfx942 (HIP)
# Provides:
#   MORI_GPU_LANG             CUDA or HIP: the CMake language used for device code
#   mori_gpu_sources(f...)    compile the given .cpp files as ${MORI_GPU_LANG}; kernels stay .cpp
#   mori_gpu_runtime          INTERFACE target: GPU runtime library + MORI_BACKEND_CUDA=1 or
#                             MORI_BACKEND_HIP=1 (+ __HIP_PLATFORM_AMD__=1 so plain C++ TUs can
#                             include the HIP runtime API)
#
# HIP uses CMake's own HIP language (clang as the compiler, never hipcc). Two toolchain layouts:
#   * ROCm (/opt/rocm or $ROCM_PATH): works as is; the compiler is ROCm's clang.
#   * Debian packages (hipcc, libamdhip64-dev, rocm-device-libs): the HIP package lives in /usr
#     with its CMake files under /usr/lib/<multiarch>/cmake, which CMake's HIP support does not
#     look for, and clang needs to be told where HIP and the device libraries are. Handled below.
# Include this file from the top-level directory: compile flags it adds are directory-scoped.

include_guard(GLOBAL)

# ---------------------------------------------------------------------------------------------
# Backend resolution
string(TOUPPER "${MORI_GPU_BACKEND}" _mori_backend)
if(_mori_backend STREQUAL "" OR _mori_backend STREQUAL "AUTO")
  # An explicitly chosen compiler decides; otherwise nvcc wins over HIP.
  if(CMAKE_CUDA_COMPILER OR DEFINED ENV{CUDACXX})
    set(_mori_backend CUDA)
  elseif(CMAKE_HIP_COMPILER OR DEFINED ENV{HIPCXX})
    set(_mori_backend HIP)
  else()
    find_program(MORI_NVCC nvcc HINTS ENV CUDA_PATH ENV CUDA_HOME PATH_SUFFIXES bin
                 PATHS /usr/local/cuda/bin)
    if(MORI_NVCC)
      set(_mori_backend CUDA)
    endif()
  endif()
endif()

# Locate the HIP installation: a prefix containing lib/cmake/hip-lang (ROCm layout) or
# lib/<multiarch>/cmake/hip-lang (Debian layout).
set(_mori_rocm_prefix "")
if(NOT _mori_backend STREQUAL "CUDA")
  foreach(_p IN ITEMS "${ROCM_PATH}" "$ENV{ROCM_PATH}" /opt/rocm /usr)
    if(_p AND EXISTS "${_p}/lib/cmake/hip-lang/hip-lang-config.cmake")
      set(_mori_rocm_prefix "${_p}")
      set(_mori_hip_lang_dir "${_p}/lib/cmake/hip-lang")
      break()
    elseif(_p AND EXISTS "${_p}/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/hip-lang/hip-lang-config.cmake")
      set(_mori_rocm_prefix "${_p}")
      set(_mori_hip_lang_dir "${_p}/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/hip-lang")
      break()
    endif()
  endforeach()
  if(_mori_backend STREQUAL "AUTO" OR _mori_backend STREQUAL "")
    if(_mori_rocm_prefix)
      set(_mori_backend HIP)
    else()
      message(FATAL_ERROR
        "MORI_GPU_BACKEND=AUTO: no GPU toolchain found. Install the CUDA toolkit (nvcc on PATH, "
        "or set CUDA_PATH / CMAKE_CUDA_COMPILER) or ROCm/HIP (set ROCM_PATH; on Debian: apt-get "
        "install hipcc libamdhip64-dev rocm-device-libs), or set MORI_GPU_BACKEND explicitly.")
    endif()
  endif()
endif()
if(NOT _mori_backend MATCHES "^(CUDA|HIP)$")
  message(FATAL_ERROR "MORI_GPU_BACKEND must be CUDA, HIP or AUTO (got '${MORI_GPU_BACKEND}')")
endif()
set(MORI_GPU_LANG ${_mori_backend})

# Architectures: MORI_GPU_ARCHS > user-set CMAKE_<LANG>_ARCHITECTURES > default.
if(MORI_GPU_ARCHS)
  set(CMAKE_${MORI_GPU_LANG}_ARCHITECTURES "${MORI_GPU_ARCHS}")
elseif(NOT CMAKE_${MORI_GPU_LANG}_ARCHITECTURES)
  if(MORI_GPU_LANG STREQUAL "CUDA")
    set(CMAKE_CUDA_ARCHITECTURES 90)
  else()
    set(CMAKE_HIP_ARCHITECTURES gfx942)
  endif()
endif()
set(MORI_GPU_ARCHS_RESOLVED "${CMAKE_${MORI_GPU_LANG}_ARCHITECTURES}")

# ---------------------------------------------------------------------------------------------
# CUDA
if(MORI_GPU_LANG STREQUAL "CUDA")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND MORI_NVCC)
    set(CMAKE_CUDA_COMPILER "${MORI_NVCC}")
  endif()
  # One shared cudart for the library, tests and the Python module: statically linked copies
  # would each keep their own runtime state.
  if(NOT DEFINED CMAKE_CUDA_RUNTIME_LIBRARY)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(NOT DEFINED CMAKE_CUDA_STANDARD)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  endif()
  add_library(mori_gpu_runtime INTERFACE)
  # cudart only: it loads libcuda at run time, so binaries still start on GPU-less machines
  # (linking CUDA::cuda_driver would bind to the stub and fail to load there; get driver entry
  # points through cudaGetDriverEntryPoint instead).
  target_link_libraries(mori_gpu_runtime INTERFACE CUDA::cudart)
  target_compile_definitions(mori_gpu_runtime INTERFACE MORI_BACKEND_CUDA=1)
  message(STATUS "mori GPU backend: CUDA (${CMAKE_CUDA_COMPILER}), archs: ${CMAKE_CUDA_ARCHITECTURES}")
endif()

# ---------------------------------------------------------------------------------------------
# HIP
if(MORI_GPU_LANG STREQUAL "HIP")
  if(NOT _mori_rocm_prefix)
    message(FATAL_ERROR "MORI_GPU_BACKEND=HIP but no HIP installation (hip-lang CMake package) "
                        "found; set ROCM_PATH.")
  endif()

  set(_mori_needs_gfx94x FALSE)
  foreach(_a IN LISTS CMAKE_HIP_ARCHITECTURES)
    if(_a MATCHES "^gfx94")
      set(_mori_needs_gfx94x TRUE)
    endif()
  endforeach()

  # Compiler: a plain clang++ (CMake rejects hipcc). ROCm ships its own; on Debian hipcc uses
  # clang-15, which predates gfx94x, so gfx94x targets need a newer versioned clang.
  if(NOT CMAKE_HIP_COMPILER AND NOT DEFINED ENV{HIPCXX})
    if(_mori_needs_gfx94x)
      set(_names clang++-19 clang++-18 clang++-17 clang++)
    else()
      set(_names clang++-15 clang++-19 clang++-18 clang++-17 clang++)
    endif()
    find_program(MORI_HIP_CLANG NAMES ${_names} HINTS "${_mori_rocm_prefix}/llvm/bin" NO_CACHE)
    if(NOT MORI_HIP_CLANG)
      message(FATAL_ERROR "No clang++ for HIP found (tried ${_names}); set CMAKE_HIP_COMPILER.")
    endif()
    set(CMAKE_HIP_COMPILER "${MORI_HIP_CLANG}")
  endif()
  if(CMAKE_HIP_COMPILER)
    set(_mori_hip_cc "${CMAKE_HIP_COMPILER}")
  else()
    set(_mori_hip_cc "$ENV{HIPCXX}")
  endif()
  if(NOT IS_ABSOLUTE "${_mori_hip_cc}")
    find_program(_mori_hip_cc_path "${_mori_hip_cc}" NO_CACHE)
    set(_mori_hip_cc "${_mori_hip_cc_path}")
  endif()
  get_filename_component(_mori_hip_cc_dir "${_mori_hip_cc}" REALPATH)
  get_filename_component(_mori_hip_cc_dir "${_mori_hip_cc_dir}" DIRECTORY)

  set(_mori_hip_flags "")
  set(_mori_debian_layout FALSE)
  if(NOT EXISTS "${_mori_rocm_prefix}/lib/cmake/hip-lang/hip-lang-config.cmake")
    set(_mori_debian_layout TRUE)
    # Debian layout. CMake requires <root>/lib/cmake/hip-lang, so give it a root in the build
    # tree whose hip-lang-config.cmake forwards to the real one (which resolves its own paths).
    # Its dependencies sit next to it; name them explicitly because CMake's compiler-check
    # projects search before the multiarch library directory is known.
    set(_root "${CMAKE_BINARY_DIR}/mori-rocm-root")
    get_filename_component(_pkgdir "${_mori_hip_lang_dir}" DIRECTORY)
    file(WRITE "${_root}/lib/cmake/hip-lang/hip-lang-config.cmake"
         "set(amd_comgr_DIR \"${_pkgdir}/amd_comgr\")\n"
         "include(\"${_mori_hip_lang_dir}/hip-lang-config.cmake\")\n"
         # Its targets export -isystem /usr/include, which breaks libstdc++'s #include_next.
         "set_property(TARGET hip-lang::amdhip64 hip-lang::device PROPERTY INTERFACE_INCLUDE_DIRECTORIES)\n"
         "set_property(TARGET hip-lang::amdhip64 hip-lang::device PROPERTY INTERFACE_SYSTEM_INCLUDE_DIRECTORIES)\n")
    set(CMAKE_HIP_COMPILER_ROCM_ROOT "${_root}")
    # hip-lang picks the first compiler-rt builtins under /usr/lib/clang/*; prefer the one that
    # matches the compiler.
    file(GLOB _rt "${_mori_hip_cc_dir}/../lib/clang/*/lib/linux/libclang_rt.builtins-${CMAKE_SYSTEM_PROCESSOR}.a")
    if(_rt AND NOT CLANGRT_BUILTINS)
      list(GET _rt 0 _rt)
      set(CLANGRT_BUILTINS "${_rt}" CACHE FILEPATH "compiler-rt builtins for HIP links")
    endif()
    # Distribution clang does not find HIP in /usr on its own (Debian's hipcc passes the same).
    file(STRINGS "${_mori_rocm_prefix}/include/hip/hip_version.h" _v REGEX "define HIP_VERSION_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3" _v "${_v}")
    list(APPEND _mori_hip_flags "--rocm-path=${_mori_rocm_prefix}" "--hip-version=${_v}")
  endif()

  # Device libraries (ocml/ockl/oclc_*.bc). Older ROCm releases (Debian 12: 5.2) have no
  # oclc_isa_version_94{1,2}.bc. That file only defines the ISA version constant, so derive it
  # from the gfx940 one and point clang at a private copy of the library folder.
  find_path(MORI_HIP_DEVICE_LIB_DIR ockl.bc NO_DEFAULT_PATH PATHS
            "${_mori_rocm_prefix}/amdgcn/bitcode" "${_mori_rocm_prefix}/lib/amdgcn/bitcode"
            "${_mori_rocm_prefix}/lib/${CMAKE_LIBRARY_ARCHITECTURE}/amdgcn/bitcode")
  set(_devlib "${MORI_HIP_DEVICE_LIB_DIR}")
  set(_missing "")
  foreach(_a IN LISTS CMAKE_HIP_ARCHITECTURES)
    string(REGEX REPLACE "^gfx([0-9a-f]+).*" "\\1" _isa "${_a}")
    if(_isa MATCHES "^94[12]$" AND NOT EXISTS "${_devlib}/oclc_isa_version_${_isa}.bc")
      list(APPEND _missing ${_isa})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _missing)
  if(_missing)
    set(_fixed "${CMAKE_BINARY_DIR}/mori-device-libs")
    file(GLOB _bcs "${_devlib}/*.bc")
    file(COPY ${_bcs} DESTINATION "${_fixed}")
    # Use the LLVM tools matching the compiler so the bitcode is readable by it.
    find_program(MORI_LLVM_DIS NAMES llvm-dis HINTS "${_mori_hip_cc_dir}" NO_DEFAULT_PATH NO_CACHE)
    find_program(MORI_LLVM_AS NAMES llvm-as HINTS "${_mori_hip_cc_dir}" NO_DEFAULT_PATH NO_CACHE)
    if(NOT MORI_LLVM_DIS OR NOT MORI_LLVM_AS)
      message(FATAL_ERROR "llvm-dis/llvm-as not found next to ${_mori_hip_cc}: they are needed to "
                          "make oclc_isa_version_{${_missing}}.bc (Debian: install llvm-NN).")
    endif()
    execute_process(COMMAND "${MORI_LLVM_DIS}" "${_devlib}/oclc_isa_version_940.bc" -o -
                    OUTPUT_VARIABLE _ll RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0 OR NOT _ll MATCHES "i32 9400")
      message(FATAL_ERROR "cannot derive gfx94x device library from oclc_isa_version_940.bc")
    endif()
    foreach(_isa IN LISTS _missing)
      if(EXISTS "${_fixed}/oclc_isa_version_${_isa}.bc")
        continue()
      endif()
      string(REGEX REPLACE "^([0-9])([0-9])([0-9])$" "\\1\\20\\3" _num "${_isa}")  # 942 -> 9402
      string(REPLACE "i32 9400" "i32 ${_num}" _ll_isa "${_ll}")
      file(WRITE "${_fixed}/oclc_isa_version_${_isa}.ll" "${_ll_isa}")
      execute_process(COMMAND "${MORI_LLVM_AS}" "${_fixed}/oclc_isa_version_${_isa}.ll"
                              -o "${_fixed}/oclc_isa_version_${_isa}.bc" RESULT_VARIABLE _rc)
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "llvm-as failed for oclc_isa_version_${_isa}.ll")
      endif()
    endforeach()
    set(_devlib "${_fixed}")
    message(STATUS "mori: generated device library for gfx{${_missing}} in ${_fixed}")
  endif()
  if(_devlib AND (_missing OR _mori_debian_layout))
    list(APPEND _mori_hip_flags "--rocm-device-lib-path=${_devlib}")
  endif()

  # The flags must already apply to CMake's compiler checks, hence CMAKE_HIP_FLAGS (re-applied
  # on top of the cache value after enable_language).
  list(JOIN _mori_hip_flags " " _mori_hip_flags)
  string(APPEND CMAKE_HIP_FLAGS " ${_mori_hip_flags}")
  enable_language(HIP)
  set(CMAKE_HIP_FLAGS "$CACHE{CMAKE_HIP_FLAGS} ${_mori_hip_flags}")
  if(NOT DEFINED CMAKE_HIP_STANDARD)
    set(CMAKE_HIP_STANDARD 17)
    set(CMAKE_HIP_STANDARD_REQUIRED ON)
  endif()

  add_library(mori_gpu_runtime INTERFACE)
  # Installed (mori::gpu_runtime), the runtime is HIP's package target hip::host
  # (cmake/moriConfig.cmake.in finds it): hip-lang::host exists only in projects that enable HIP.
  target_link_libraries(mori_gpu_runtime INTERFACE $<BUILD_INTERFACE:hip-lang::host>
                                                   $<INSTALL_INTERFACE:hip::host>)
  # hip-lang::host only carries include dirs/defines for HIP-language TUs; plain C++ TUs that
  # include <hip/hip_runtime_api.h> need the platform macro and the include dir as well.
  target_compile_definitions(mori_gpu_runtime INTERFACE MORI_BACKEND_HIP=1 __HIP_PLATFORM_AMD__=1)
  target_include_directories(mori_gpu_runtime SYSTEM INTERFACE
                             $<BUILD_INTERFACE:${_mori_rocm_prefix}/include>)
  message(STATUS "mori GPU backend: HIP (${CMAKE_HIP_COMPILER} ${CMAKE_HIP_COMPILER_VERSION}), "
                 "archs: ${CMAKE_HIP_ARCHITECTURES}, flags: ${_mori_hip_flags}")
endif()

# Kernels and runtime-including sources are .cpp; compile them as the GPU language.
function(mori_gpu_sources)
  set_source_files_properties(${ARGN} PROPERTIES LANGUAGE ${MORI_GPU_LANG})
endfunction()
