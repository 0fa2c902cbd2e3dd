# Install-tree consumer test (ctest: install_consumer), run as `cmake -P`.
#
# Installs the tdshm build tree into a scratch prefix, then configures, builds and runs the
# downstream project in this folder against that prefix only, with find_package(tdshm). Fails
# with the failing step's command and output.
#
# Required: -DTDSHM_BINARY_DIR=<tdshm build tree> -DCONSUMER_SOURCE_DIR=<this folder>
#           -DWORK_DIR=<scratch folder>
# Optional, so that the consumer is built like tdshm was: -DCONSUMER_GENERATOR=<generator>
#           -DCONSUMER_CXX_COMPILER=<path> -DCONSUMER_BUILD_TYPE=<type>
#           -DCONSUMER_CXX_FLAGS=<flags> (for instance the sanitizer flags a static libtdshm.a
#           was compiled with: its users must link with them too)

cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS TDSHM_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "install_consumer: -D${var}=... is required")
  endif()
endforeach()

set(prefix "${WORK_DIR}/prefix")
set(build_dir "${WORK_DIR}/build")

# run_step(<name> <command>...): runs the command; on failure stops the test with its output.
# The command's output (stdout and stderr together) is left in step_output.
function(run_step name)
  message(STATUS "install_consumer: ${name}")
  execute_process(COMMAND ${ARGN}
    RESULT_VARIABLE result
    OUTPUT_VARIABLE output
    ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "install_consumer: step '${name}' failed (${result})\n"
                        "command: ${command}\n"
                        "output:\n${output}")
  endif()
  set(step_output "${output}" PARENT_SCOPE)
endfunction()

# A fresh prefix each time, so that a file removed from the install rules cannot linger. The
# consumer's own build folder is kept: an unchanged install keeps its time stamps, and the
# consumer then rebuilds nothing.
file(REMOVE_RECURSE "${prefix}")
run_step("install tdshm into ${prefix}"
  "${CMAKE_COMMAND}" --install "${TDSHM_BINARY_DIR}" --prefix "${prefix}")

set(configure_args
  -S "${CONSUMER_SOURCE_DIR}" -B "${build_dir}"
  "-DCMAKE_PREFIX_PATH=${prefix}"
  # Only the prefix: never a tdshm registered in the user package registry.
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(CONSUMER_GENERATOR)
  list(APPEND configure_args -G "${CONSUMER_GENERATOR}")
endif()
if(CONSUMER_CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}")
endif()
if(CONSUMER_BUILD_TYPE)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONSUMER_BUILD_TYPE}")
endif()
if(DEFINED CONSUMER_CXX_FLAGS)
  list(APPEND configure_args "-DCMAKE_CXX_FLAGS=${CONSUMER_CXX_FLAGS}")
endif()
run_step("configure the consumer" "${CMAKE_COMMAND}" ${configure_args})

# The package must come from the fresh prefix, not from the source or build tree.
file(STRINGS "${build_dir}/CMakeCache.txt" tdshm_dir_line REGEX "^tdshm_DIR:")
string(REGEX REPLACE "^tdshm_DIR:[A-Z]+=" "" tdshm_dir "${tdshm_dir_line}")
cmake_path(IS_PREFIX prefix "${tdshm_dir}" NORMALIZE from_prefix)
if(NOT from_prefix)
  message(FATAL_ERROR "install_consumer: find_package(tdshm) found '${tdshm_dir}', "
                      "which is not under the install prefix '${prefix}'")
endif()

run_step("build the consumer" "${CMAKE_COMMAND}" --build "${build_dir}" --parallel 2)

run_step("run the consumer" "${build_dir}/tdshm_consumer")
string(FIND "${step_output}" "consumer ok" found)
if(found EQUAL -1)
  message(FATAL_ERROR "install_consumer: the consumer ran but did not print 'consumer ok'; "
                      "its output:\n${step_output}")
endif()
message(STATUS "install_consumer: ok")
