# The example plugin (examples/plugin/example_plugin.c, plain C against include/moe_harness/
# plugin.h) in three builds, and the ctests of the plugin route and of `check`'s CI contract:
#   - correct: `check --plugin` passes every op it implements;
#   - planted bugs: every op fails, with a replay line that reproduces the failure;
#   - another ABI version: refused with a clear message (exit 2);
#   - bad case lines: usage errors naming the key (exit 2); JSON and JUnit reports are written;
#   - a race that shows on the 4th call of a case: passes 2 calls a case, fails `--runs 5`;
#   - a crash and a hang in a call: the case named with its replay line (`--case-timeout`);
#   - `bench --impl`: the device-memory build timed next to moe-gpu (GPU), its usage errors (CPU).
if(NOT MOE_BUILD_TESTS)
  return()
endif()
enable_language(C)

# moe_example_plugin(target source library definitions...)
function(moe_example_plugin target source library)
  add_library(${target} MODULE ${PROJECT_SOURCE_DIR}/examples/plugin/${source})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include)
  target_compile_options(${target} PRIVATE -std=c11 -Wall -Wextra -fvisibility=hidden)
  target_compile_definitions(${target} PRIVATE ${ARGN})
  target_link_libraries(${target} PRIVATE dlpack::dlpack ${library})
endfunction()
moe_example_plugin(moe_example_plugin example_plugin.c m)
moe_example_plugin(moe_example_plugin_buggy example_plugin.c m MOE_EXAMPLE_PLANT_BUGS=1)
moe_example_plugin(moe_example_plugin_abi99 example_plugin.c m MOE_EXAMPLE_ABI_VERSION=99)
moe_example_plugin(moe_example_plugin_flaky example_plugin.c m MOE_EXAMPLE_FLAKY_CALL=4)
moe_example_plugin(moe_example_plugin_faulty example_plugin.c m MOE_EXAMPLE_FAULTS=1)

set(_plugin_test ${PROJECT_SOURCE_DIR}/examples/plugin/test_plugin.sh)
add_test(NAME plugin_example_passes
         COMMAND sh ${_plugin_test} passes $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin>)
add_test(NAME plugin_planted_bugs_caught
         COMMAND sh ${_plugin_test} buggy $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin_buggy>)
add_test(NAME plugin_abi_mismatch_refused
         COMMAND sh ${_plugin_test} abi $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin_abi99>)
add_test(NAME check_bad_case_lines
         COMMAND sh ${_plugin_test} usage $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin>)
add_test(NAME check_reports
         COMMAND sh ${_plugin_test} reports $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin_buggy>)
add_test(NAME check_runs_hunt_races
         COMMAND sh ${_plugin_test} flaky $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin_flaky>)
add_test(NAME check_names_a_crash_or_a_hang
         COMMAND sh ${_plugin_test} faulty $<TARGET_FILE:moe-harness>
                 $<TARGET_FILE:moe_example_plugin_faulty>)
set_tests_properties(plugin_example_passes plugin_planted_bugs_caught plugin_abi_mismatch_refused
                     check_bad_case_lines check_reports check_runs_hunt_races
                     check_names_a_crash_or_a_hang PROPERTIES LABELS cpu TIMEOUT 600)

# The device-memory variant (kDLCUDA), where the CUDA toolkit is: runs on the GPU machine, and
# skips (77) without a GPU.
if(MOE_WITH_CUDA)
  moe_example_plugin(moe_example_cuda_plugin example_cuda_plugin.c CUDA::cudart)
  moe_example_plugin(moe_example_cuda_plugin_buggy example_cuda_plugin.c CUDA::cudart
                     MOE_EXAMPLE_PLANT_BUGS=1)
  add_test(NAME plugin_cuda_example_passes
           COMMAND sh ${_plugin_test} cuda_passes $<TARGET_FILE:moe-harness>
                   $<TARGET_FILE:moe_example_cuda_plugin>)
  add_test(NAME plugin_cuda_planted_bug_caught
           COMMAND sh ${_plugin_test} cuda_buggy $<TARGET_FILE:moe-harness>
                   $<TARGET_FILE:moe_example_cuda_plugin_buggy>)
  # `bench --impl example-cuda --plugin ...`: the device-memory plugin timed next to moe-gpu.
  add_test(NAME bench_impl_plugin
           COMMAND sh ${_plugin_test} cuda_bench $<TARGET_FILE:moe-harness>
                   $<TARGET_FILE:moe_example_cuda_plugin>)
  set_tests_properties(plugin_cuda_example_passes plugin_cuda_planted_bug_caught bench_impl_plugin
                       PROPERTIES LABELS gpu TIMEOUT 600 SKIP_RETURN_CODE 77)
  # Its usage errors (checked before bench looks for a GPU).
  add_test(NAME bench_impl_usage
           COMMAND sh ${_plugin_test} bench_usage $<TARGET_FILE:moe-harness>
                   $<TARGET_FILE:moe_example_plugin> $<TARGET_FILE:moe_example_cuda_plugin>)
  set_tests_properties(bench_impl_usage PROPERTIES LABELS cpu TIMEOUT 600)
endif()
