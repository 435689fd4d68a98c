# The consumer example as a ctest (cmake -P). Variables (-D):
#   MODE          installed:    cmake --install BUILD_DIR into WORK_DIR/prefix, build the consumer
#                               with find_package(moe_harness) and run it (exit 0 expected)
#                 planted_bug:  run the consumer built by `installed` with --bug (exit 1 expected)
#                 subdirectory: build the consumer with add_subdirectory(SOURCE_DIR), CPU-only,
#                               only the moe_consumer target, and run it (exit 0 expected). It
#                               compiles the libraries again, so without optimisation (no build
#                               type: about a quarter less compile time than Release); the
#                               installed variant is Release.
#   SOURCE_DIR    the moe-harness source tree;  BUILD_DIR  its build tree
#   WORK_DIR      where prefix/ and the consumer builds go
#   GENERATOR, CXX_COMPILER  passed on to the consumer's configure
cmake_minimum_required(VERSION 3.25)
foreach(v MODE SOURCE_DIR BUILD_DIR WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run_consumer.cmake: -D${v}=... missing")
  endif()
endforeach()
set(consumer_src ${SOURCE_DIR}/examples/consumer)
set(prefix ${WORK_DIR}/prefix)
cmake_host_system_information(RESULT nproc QUERY NUMBER_OF_LOGICAL_CORES)

function(step what)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  message(STATUS "consumer: ${what}: exit ${rc}, ${dt} s")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer: ${what} failed (exit ${rc})")
  endif()
endfunction()

function(configure_and_build bin build_type)
  set(args -S ${consumer_src} -B ${bin} -DCMAKE_BUILD_TYPE=${build_type} ${ARGN})
  if(GENERATOR)
    list(APPEND args -G ${GENERATOR})
  endif()
  if(CXX_COMPILER)
    list(APPEND args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
  endif()
  file(REMOVE_RECURSE ${bin})
  step("configure ${bin}" ${CMAKE_COMMAND} ${args})
  step("build moe_consumer" ${CMAKE_COMMAND} --build ${bin} --target moe_consumer -j ${nproc})
endfunction()

# Runs the consumer; fails unless it exits with `expect` exactly.
function(run_consumer bin expect)
  execute_process(COMMAND ${bin}/moe_consumer ${ARGN} RESULT_VARIABLE rc)
  message(STATUS "consumer: moe_consumer ${ARGN}: exit ${rc} (expected ${expect})")
  if(NOT "${rc}" STREQUAL "${expect}")
    message(FATAL_ERROR "consumer: moe_consumer ${ARGN} exited ${rc}, expected ${expect}")
  endif()
endfunction()

if(MODE STREQUAL "installed")
  file(REMOVE_RECURSE ${prefix})
  step("install into ${prefix}" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
  # Only the installed package: nothing of the source or build tree may be needed.
  configure_and_build(${WORK_DIR}/installed Release -DCMAKE_PREFIX_PATH=${prefix})
  run_consumer(${WORK_DIR}/installed 0)
elseif(MODE STREQUAL "planted_bug")
  run_consumer(${WORK_DIR}/installed 1 --bug)
elseif(MODE STREQUAL "subdirectory")
  configure_and_build(${WORK_DIR}/subdirectory "" -DMOE_HARNESS_SOURCE_DIR=${SOURCE_DIR})
  run_consumer(${WORK_DIR}/subdirectory 0)
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()
