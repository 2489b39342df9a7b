# cmake -DMORI_SOURCE_DIR=<repo> -DMORI_BUILD_DIR=<build> -DMORI_PREFIX=<scratch prefix>
#       -DMORI_LIBDIR=<lib> -DMORI_WITH_MPI_PLUGIN=<0|1> -P check_install.cmake
# Installs the build into a scratch prefix and checks what is there: exactly the public headers of
# cmake/MoriPublicHeaders.cmake, libmori with the emulated NIC (and the MPI plugin when built) next
# to it, the CMake package without a path into the source or build tree; then builds and runs
# tests/package/consumer (plain C++, find_package(mori) from that prefix) against it.
cmake_minimum_required(VERSION 3.24)
include("${MORI_SOURCE_DIR}/cmake/MoriPublicHeaders.cmake")
set(_passed 0)
set(_failed 0)
# check(<name> <condition...> MESSAGE <text...>)
function(check name)
  cmake_parse_arguments(PARSE_ARGV 1 _c "" "" "MESSAGE")
  if(${_c_UNPARSED_ARGUMENTS})
    math(EXPR _n "${_passed} + 1")
    set(_passed ${_n} PARENT_SCOPE)
    message("PASS ${name}")
  else()
    math(EXPR _n "${_failed} + 1")
    set(_failed ${_n} PARENT_SCOPE)
    string(JOIN " " _m ${_c_MESSAGE})
    message("FAIL ${name}: ${_m}")
  endif()
endfunction()

file(REMOVE_RECURSE "${MORI_PREFIX}" "${MORI_PREFIX}-consumer")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${MORI_BUILD_DIR}" --prefix "${MORI_PREFIX}"
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${_rc}):\n${_out}\n0 passed, 1 failed")
endif()

# Headers: the public list, nothing more.
file(GLOB_RECURSE _installed RELATIVE "${MORI_PREFIX}/include" "${MORI_PREFIX}/include/*")
set(_extra ${_installed})
list(REMOVE_ITEM _extra ${MORI_PUBLIC_HEADERS})
set(_missing ${MORI_PUBLIC_HEADERS})
list(REMOVE_ITEM _missing ${_installed})
check("headers: exactly the public ones" NOT _extra AND NOT _missing
      MESSAGE "not public: ${_extra}; missing: ${_missing}")

# libmori and what it finds in its own directory.
set(_lib "${MORI_PREFIX}/${MORI_LIBDIR}")
check("libmori" EXISTS "${_lib}/libmori.so" MESSAGE "no ${_lib}/libmori.so")
check("emulated NIC next to libmori" EXISTS "${_lib}/mori-emulated-nic"
      MESSAGE "no ${_lib}/mori-emulated-nic")
if(MORI_WITH_MPI_PLUGIN)
  check("MPI plugin next to libmori" EXISTS "${_lib}/libmori_mpi_bootstrap.so"
        MESSAGE "no ${_lib}/libmori_mpi_bootstrap.so")
endif()

# The package.
set(_pkg "${_lib}/cmake/mori")
set(_files moriConfig.cmake moriConfigVersion.cmake moriTargets.cmake moriGpuSources.cmake)
if(MORI_WITH_MPI_PLUGIN)
  list(APPEND _files moriMpiBootstrapTargets.cmake)
endif()
set(_absent "")
foreach(_f IN LISTS _files)
  if(NOT EXISTS "${_pkg}/${_f}")
    list(APPEND _absent "${_f}")
  endif()
endforeach()
check("package files" NOT _absent MESSAGE "missing in ${_pkg}: ${_absent}")
file(GLOB _cmakeFiles "${_pkg}/*.cmake")
set(_leaks "")
foreach(_f IN LISTS _cmakeFiles)
  file(READ "${_f}" _text)
  foreach(_dir IN ITEMS "${MORI_SOURCE_DIR}" "${MORI_BUILD_DIR}")
    string(FIND "${_text}" "${_dir}" _at)
    if(NOT _at EQUAL -1)
      list(APPEND _leaks "${_f} names ${_dir}")
    endif()
  endforeach()
endforeach()
check("package names no source or build path" NOT _leaks MESSAGE "${_leaks}")

# A plain C++ program built against the prefix alone, run (no GPU needed).
file(STRINGS "${MORI_BUILD_DIR}/CMakeCache.txt" _cache
     REGEX "^(CMAKE_GENERATOR|CMAKE_MAKE_PROGRAM|CMAKE_CXX_COMPILER|CMAKE_CUDA_COMPILER|CMAKE_HIP_COMPILER):")
set(_args "")
foreach(_line IN LISTS _cache)
  string(REGEX REPLACE "^([A-Z_]+):[A-Z]+=(.*)$" "-D\\1=\\2" _a "${_line}")
  if(_line MATCHES "^CMAKE_GENERATOR:")
    string(REGEX REPLACE "^CMAKE_GENERATOR:[A-Z]+=(.*)$" "\\1" _gen "${_line}")
  else()
    list(APPEND _args "${_a}")
  endif()
endforeach()
set(_cb "${MORI_PREFIX}-consumer")
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${MORI_SOURCE_DIR}/tests/package/consumer"
                        -B "${_cb}" -G "${_gen}" ${_args} "-DCMAKE_PREFIX_PATH=${MORI_PREFIX}"
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(_rc EQUAL 0)
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${_cb}"
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
endif()
check("consumer configures and builds with find_package(mori)" _rc EQUAL 0 MESSAGE "\n${_out}")
if(_rc EQUAL 0)
  execute_process(COMMAND "${_cb}/mori_package_consumer" RESULT_VARIABLE _rc
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  message("${_out}")
  check("consumer runs against the installed libmori" _rc EQUAL 0 MESSAGE "exit ${_rc}")
endif()

message("${_passed} passed, ${_failed} failed")
if(_failed GREATER 0)
  message(FATAL_ERROR "the installed package is not right")
endif()
