# dlpack::dlpack, the DLPack header (dlpack/dlpack.h) that include/moe_harness/impl.h and
# plugin.h include. Header only: from dlpack's own CMake package when there is one (Debian's
# libdlpack-dev and upstream dlpack install it), else from the header alone. Used by the build
# and by the installed moe_harnessConfig.cmake.
if(NOT TARGET dlpack::dlpack)
  find_package(dlpack CONFIG QUIET)
endif()
if(NOT TARGET dlpack::dlpack)
  find_path(MOE_DLPACK_INCLUDE_DIR dlpack/dlpack.h)
  if(MOE_DLPACK_INCLUDE_DIR)
    add_library(dlpack::dlpack INTERFACE IMPORTED)
    set_target_properties(dlpack::dlpack PROPERTIES
                          INTERFACE_INCLUDE_DIRECTORIES "${MOE_DLPACK_INCLUDE_DIR}")
  endif()
endif()
if(NOT TARGET dlpack::dlpack)
  string(CONCAT _moe_dlpack_msg "dlpack/dlpack.h not found (Debian: apt-get install "
                "libdlpack-dev; or set dlpack_DIR or MOE_DLPACK_INCLUDE_DIR)")
  if(CMAKE_FIND_PACKAGE_NAME STREQUAL "moe_harness")
    set(moe_harness_FOUND FALSE)
    set(moe_harness_NOT_FOUND_MESSAGE "${_moe_dlpack_msg}")
  else()
    message(FATAL_ERROR "${_moe_dlpack_msg}")
  endif()
endif()
