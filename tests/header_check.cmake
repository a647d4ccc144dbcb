# The test headers_self_contained (tests/CMakeLists.txt): every header listed in HEADERS_FILE
# (paths under ROOT) opens with `#pragma once` after its leading comment, so including it twice
# is harmless; then the generated sources of the headers no build source includes first are
# compiled (target dstrain_header_check in BUILD). Any failure names the header.
file(STRINGS ${HEADERS_FILE} headers)
set(bad "")
foreach(h ${headers})
  # The first line that is neither blank nor a // comment.
  file(STRINGS ${ROOT}/${h} first ENCODING UTF-8 REGEX "^[ \t]*[^/ \t]" LIMIT_COUNT 1)
  set(guarded FALSE)
  if(first MATCHES "^#pragma once[ \t]*$")
    set(guarded TRUE)
  endif()
  if(NOT guarded)
    list(APPEND bad ${h})
  endif()
endforeach()
if(bad)
  message(FATAL_ERROR "headers without `#pragma once` after their leading comment: ${bad}")
endif()
list(LENGTH headers n)
message(STATUS "${n} headers open with #pragma once")
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD} --target dstrain_header_check -- -k 0 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "a header does not compile on its own (the build's output above names it)")
endif()
