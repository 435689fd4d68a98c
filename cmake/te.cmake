# The TransformerEngine plugin (integrations/te, issue 18): TE's router-family kernels
# (fused_router.h) through the plugin ABI, and the ctest te_router_conformance that runs
# `moe-harness check` over them. Built only when configured with -DMOE_TE_ROOT=<TE root holding
# include/transformer_engine/ and lib/libtransformer_engine.so> and the CUDA backend; otherwise
# (CI) te_router_conformance reports itself skipped (77), never passed.
# Included from the top-level CMakeLists.txt:
#   include(${PROJECT_SOURCE_DIR}/cmake/te.cmake OPTIONAL)
set(MOE_TE_ROOT "" CACHE PATH
    "TransformerEngine root with include/transformer_engine/ and lib/ (builds the TE plugin)")

set(_moe_te_script ${PROJECT_SOURCE_DIR}/integrations/te/test_te_plugin.sh)
set(_moe_te_skip "")
if(NOT MOE_TE_ROOT)
  set(_moe_te_skip "configure with -DMOE_TE_ROOT=<TE root with include/ and lib/> to build the "
                   "TransformerEngine plugin (integrations/te/README.md)")
elseif(NOT MOE_WITH_CUDA)
  set(_moe_te_skip "MOE_TE_ROOT is set but the CUDA backend is off (MOE_WITH_CUDA), and the "
                   "TransformerEngine plugin needs the CUDA toolkit")
elseif(NOT EXISTS ${MOE_TE_ROOT}/include/transformer_engine/fused_router.h)
  set(_moe_te_skip "MOE_TE_ROOT=${MOE_TE_ROOT} has no include/transformer_engine/fused_router.h")
endif()
string(JOIN "" _moe_te_skip ${_moe_te_skip})

if(_moe_te_skip)
  if(MOE_TE_ROOT)
    message(WARNING "moe-harness: TransformerEngine plugin not built: ${_moe_te_skip}")
  endif()
  if(MOE_BUILD_TESTS)
    add_test(NAME te_router_conformance COMMAND sh ${_moe_te_script} skip "${_moe_te_skip}")
    set_tests_properties(te_router_conformance PROPERTIES LABELS cpu SKIP_RETURN_CODE 77)
  endif()
  return()
endif()

# The version of the TE build, from the TE_VERSION file that ../shared/gpu-deps/te/fetch_te.sh
# writes (the wheel's metadata: "Version: 2.20.2"); TE's C API has no version query.
set(_moe_te_version "2.20.x")
if(EXISTS ${MOE_TE_ROOT}/TE_VERSION)
  file(STRINGS ${MOE_TE_ROOT}/TE_VERSION _moe_te_version_line REGEX "^Version: ")
  if(_moe_te_version_line)
    string(REGEX REPLACE "^Version: *([^ ]+).*" "\\1" _moe_te_version "${_moe_te_version_line}")
  endif()
endif()
set(_moe_te_lib ${MOE_TE_ROOT}/lib/libtransformer_engine.so)
message(STATUS "moe-harness: TransformerEngine ${_moe_te_version} plugin (library ${_moe_te_lib}, "
               "loaded at run time)")

# TE is not linked: the plugin dlopens it at its first run (RTLD_LAZY, see the source).
add_library(moe_te_plugin MODULE ${PROJECT_SOURCE_DIR}/integrations/te/te_router_plugin.cpp)
set_target_properties(moe_te_plugin PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON
                                               CXX_VISIBILITY_PRESET hidden PREFIX "lib"
                                               OUTPUT_NAME moe_te_plugin)
target_include_directories(moe_te_plugin PRIVATE ${PROJECT_SOURCE_DIR}/include)
target_include_directories(moe_te_plugin SYSTEM PRIVATE ${MOE_TE_ROOT}/include)
target_compile_options(moe_te_plugin PRIVATE -Wall -Wextra)
target_compile_definitions(moe_te_plugin PRIVATE MOE_TE_VERSION="${_moe_te_version}"
                                                 MOE_TE_DEFAULT_LIB="${_moe_te_lib}")
target_link_libraries(moe_te_plugin PRIVATE dlpack::dlpack nlohmann_json::nlohmann_json
                                            CUDA::cudart ${CMAKE_DL_LIBS})

if(MOE_BUILD_TESTS)
  # Skips (77) without a GPU or without the library file; LD_LIBRARY_PATH must resolve TE's
  # dependencies (on the GPU machine: export LD_LIBRARY_PATH=$(bash .te/unpack_te.sh .te)).
  add_test(NAME te_router_conformance
           COMMAND sh ${_moe_te_script} run $<TARGET_FILE:moe-harness>
                   $<TARGET_FILE:moe_te_plugin> ${_moe_te_lib} ${PROJECT_SOURCE_DIR})
  set_tests_properties(te_router_conformance PROPERTIES LABELS "gpu;te" SKIP_RETURN_CODE 77
                                                        TIMEOUT 1800)
endif()
