# The link_graph test (docs/architecture.md "Libraries and their rules"): regenerates the
# build's target graph (`cmake --graphviz`, which re-runs the configure step of BUILD_DIR with
# its cache, a few seconds) and fails when a library reaches, through any chain of links, a
# library its rule forbids. Usage: cmake -DBUILD_DIR=<build> -DOUT=<file.dot> -P check_link_graph.cmake
cmake_minimum_required(VERSION 3.25)
if(NOT BUILD_DIR OR NOT OUT)
  message(FATAL_ERROR "check_link_graph: set -DBUILD_DIR=<build dir> and -DOUT=<dot file>")
endif()

# Rules: "<library> @ <regex of what it must not reach> @ <why>".
set(rules
  "fm_coordinator @ ^(fm_worker|fm_model|fm_model_cuda|fm_kernels_cpu|fm_kernels_cuda|fm_net_nccl)$ @ the coordinator runs no math and no data plane"
  "fm_coordinator @ ^CUDA:: @ the coordinator needs no CUDA runtime"
  "fm_coordinator @ nccl @ the coordinator needs no NCCL"
  "fm_coordinator @ ^fm_model_fixtures$ @ test fixtures stay out of the daemon"
  "fm_worker @ ^(fm_model_fixtures|fm_coordinator)$ @ the worker links neither the test fixtures nor the coordinator"
  "fm_model_core @ ^(fm_kernels_cpu|fm_kernels_cuda)$ @ what every process links has no math kernels")

execute_process(COMMAND ${CMAKE_COMMAND} --graphviz=${OUT} ${BUILD_DIR}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_link_graph: cmake --graphviz in ${BUILD_DIR} failed (${rc}):\n${err}")
endif()

# Edges are written as `"nodeA" -> "nodeB" ... // from -> to`.
file(STRINGS ${OUT} edge_lines REGEX "// .* -> ")
set(targets)
foreach(line IN LISTS edge_lines)
  string(REGEX REPLACE "^.*// (.*) -> (.*)$" "\\1;\\2" edge "${line}")
  list(GET edge 0 from)
  list(GET edge 1 to)
  string(MAKE_C_IDENTIFIER "${from}" from_id)
  list(APPEND "links_${from_id}" "${to}")
  list(APPEND targets "${from}")
endforeach()

set(failures)
foreach(rule IN LISTS rules)
  string(REPLACE " @ " ";" parts "${rule}")
  list(GET parts 0 library)
  list(GET parts 1 forbidden)
  list(GET parts 2 why)
  if(NOT library IN_LIST targets)
    list(APPEND failures "${library}: not in the graph (renamed? update the rules)")
    continue()
  endif()
  # Breadth-first over the links, remembering how each target was reached.
  set(queue "${library}")
  set(seen "${library}")
  string(MAKE_C_IDENTIFIER "${library}" id)
  set("path_${id}" "${library}")
  while(queue)
    list(POP_FRONT queue node)
    string(MAKE_C_IDENTIFIER "${node}" node_id)
    foreach(next IN LISTS "links_${node_id}")
      if(next IN_LIST seen)
        continue()
      endif()
      list(APPEND seen "${next}")
      list(APPEND queue "${next}")
      string(MAKE_C_IDENTIFIER "${next}" next_id)
      set("path_${next_id}" "${path_${node_id}} -> ${next}")
      if(next MATCHES "${forbidden}")
        list(APPEND failures "${library} links ${next} (${path_${next_id}}): ${why}")
      endif()
    endforeach()
  endwhile()
endforeach()

if(failures)
  list(JOIN failures "\n  " text)
  message(FATAL_ERROR "link graph breaks the architecture's rules:\n  ${text}")
endif()
list(LENGTH rules n)
message(STATUS "link graph: ${n} rules hold")
