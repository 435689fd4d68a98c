# The moe_harness Python package (python/, issue 17): ctest python_package builds and installs it
# CPU-only into a venv under the build tree (build/python/venv; its CMake build dir persists in
# build/python/ext) and runs pytest over tests/python with the CLI built here. Label cpu; skipped
# (77) only without a usable Python/pip or a reachable package index.
# Included from the top-level CMakeLists.txt:
#   include(${PROJECT_SOURCE_DIR}/cmake/python.cmake OPTIONAL)
if(NOT MOE_BUILD_TESTS)
  return()
endif()
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND)
  set(_moe_py ${Python3_EXECUTABLE})
else()
  set(_moe_py python3)
endif()
add_test(NAME python_package
         COMMAND ${CMAKE_COMMAND} -E env MOE_HARNESS_CLI=$<TARGET_FILE:moe-harness>
                 sh ${PROJECT_SOURCE_DIR}/tests/python/run_package_tests.sh ${_moe_py}
                 ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR}/python)
# The first run compiles the CPU libraries once more for the extension (about 5-8 minutes on
# 2 shared cores); later runs reuse build/python/ext.
set_tests_properties(python_package PROPERTIES LABELS cpu SKIP_RETURN_CODE 77 TIMEOUT 1800)
