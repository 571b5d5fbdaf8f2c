# Runs the plm executable and checks its exit status and output, for ctest.
#   cmake -DPLM=path -DARGS="deck --check x.yaml" -DRC=1 [-DMATCH=re1@@re2] [-DNO_MATCH=re@@re]
#         [-DLAUNCH="mpiexec -n 2 --oversubscribe"] -P expect.cmake
# MATCH / NO_MATCH are regular expressions over stdout and stderr together, separated by @@
# (a ';' would split the ctest argument).
separate_arguments(args UNIX_COMMAND "${ARGS}")
separate_arguments(launch UNIX_COMMAND "${LAUNCH}")
execute_process(COMMAND ${launch} ${PLM} ${args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
set(report "command: ${LAUNCH} plm ${ARGS}\nexit status: ${rc}\noutput:\n${all}")
if(NOT "${rc}" STREQUAL "${RC}")
  message(FATAL_ERROR "expected exit status ${RC}\n${report}")
endif()
string(REPLACE "@@" ";" match "${MATCH}")
string(REPLACE "@@" ";" no_match "${NO_MATCH}")
foreach(re IN LISTS match)
  if(NOT all MATCHES "${re}")
    message(FATAL_ERROR "output does not match `${re}`\n${report}")
  endif()
endforeach()
foreach(re IN LISTS no_match)
  if(all MATCHES "${re}")
    message(FATAL_ERROR "output matches `${re}`, which it must not\n${report}")
  endif()
endforeach()
