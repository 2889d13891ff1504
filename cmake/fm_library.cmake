# fm_glob_library(NAME DIR EXT LIBS...): a static library from every source in DIR.
function(fm_glob_library name dir ext)
  file(GLOB srcs CONFIGURE_DEPENDS ${dir}/*.${ext})
  if(NOT srcs)
    message(FATAL_ERROR "${name}: no *.${ext} sources in ${dir}")
  endif()
  add_library(${name} STATIC ${srcs})
  target_link_libraries(${name} PUBLIC ${ARGN})
endfunction()
