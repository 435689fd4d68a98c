# The sanitizer gate (ctest label `sanitize`): compute-sanitizer memcheck (with leak check),
# racecheck, initcheck and synccheck over the GPU tests of every GPU op, one ctest per family of
# ops and tool (scripts/gpu_sanitize.sh says what each family runs), with MOE_GPU_NO_CACHE=1.
#
#   ctest --test-dir build -L sanitize            # all 17 (GPU machine; about 10-30 min)
#   ctest --test-dir build -L sanitize -R block   # one family
#
# Not in the default labels: scripts/test.sh must exclude it (-LE 'fuzz|multi_gpu|sanitize').
# Without a GPU or compute-sanitizer each test is reported as skipped (exit 77). The fill-the-GPU
# determinism tests (tests/gpu/test_determinism_gpu.cpp) are ordinary `gpu` tests.
#
# Included by the top-level CMakeLists.txt after moe_gpu_tests is defined.
if(NOT MOE_WITH_CUDA OR NOT TARGET moe_gpu_tests)
  return()
endif()

# What initcheck does not see on this machine (bulk copies, TMA stores, cuBLAS): the probes whose
# findings gpu_sanitize.sh's initcheck knobs stand in for (scripts/initcheck_probes.sh).
add_test(NAME sanitize_initcheck_probes
         COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/initcheck_probes.sh --skip-code 77
                 ${PROJECT_BINARY_DIR}/sanitize/initcheck_probes)
set_tests_properties(sanitize_initcheck_probes PROPERTIES LABELS sanitize SKIP_RETURN_CODE 77
                     TIMEOUT 600)

foreach(moe_san_family router dispatch gemm block)
  foreach(moe_san_tool memcheck racecheck initcheck synccheck)
    set(moe_san_name sanitize_${moe_san_family}_${moe_san_tool})
    add_test(NAME ${moe_san_name}
             COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/gpu_sanitize.sh --family ${moe_san_family}
                     --tools ${moe_san_tool} --skip-code 77 ${PROJECT_BINARY_DIR}
                     ${PROJECT_BINARY_DIR}/sanitize/${moe_san_family})
    # Each sanitized run holds the GPU and a few cores (the CPU reference of every case).
    set_tests_properties(${moe_san_name} PROPERTIES LABELS sanitize SKIP_RETURN_CODE 77
                         TIMEOUT 2400 PROCESSORS 2 ENVIRONMENT MOE_GPU_NO_CACHE=1)
  endforeach()
endforeach()
