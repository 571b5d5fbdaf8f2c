# Routing balance while training on real proteins (doc/model.md "Router initialisation"): prepares
# Debian's mmseqs2 example proteins with `plm prep`, trains an MoE of hidden 640 (2 layers, 8
# experts of 1280, top-2, 4,096 tokens per step, lr 2e-3 after 5 warm-up steps) for STEPS steps
# and fails if any step's worst per-layer load max/mean is above BOUND.  Without
# moe.router_projection the load reaches 4.00 (two experts take every token) from step 2; with it
# the worst step of the first 40 is 2.10 (at 4,096 tokens per step, a few dozen proteins, part of
# the imbalance is sampling).
#   cmake -DPLM=path -DDECK=deck.yaml -DOUT=dir -DSTEPS=n -DBOUND=x [-DSET="key=value ..."]
#         -P moe_balance.cmake
set(proteins /usr/share/doc/mmseqs2/example-data/DB.fasta.gz)
if(NOT EXISTS ${proteins})
  message("SKIP: ${proteins} is absent (Debian package mmseqs2-examples)")
  return()
endif()
file(MAKE_DIRECTORY ${OUT})
if(NOT EXISTS ${OUT}/data/train.h5)
  execute_process(COMMAND ${PLM} prep ${proteins} --out ${OUT}/data --valid-fraction 0.05
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "plm prep failed (${rc}):\n${out}")
  endif()
endif()
separate_arguments(sets UNIX_COMMAND "${SET}")
set(args)
foreach(s IN LISTS sets)
  list(APPEND args --set ${s})
endforeach()
execute_process(COMMAND ${PLM} train ${DECK} --set data.train=${OUT}/data/train.h5
  --set data.valid=${OUT}/data/valid.h5 --set train.steps=${STEPS} --set train.run_dir=${OUT}/run
  --set checkpoint.dir=${OUT}/run/ckpt --set checkpoint.resume=none
  ${args} WORKING_DIRECTORY ${OUT} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "plm train failed (${rc}):\n${all}")
endif()
string(REGEX MATCHALL "step [0-9]+/[0-9]+ [^\n]*moe load max/mean [0-9.]+" lines "${all}")
list(LENGTH lines n)
if(NOT n EQUAL STEPS)
  message(FATAL_ERROR "expected ${STEPS} step lines with the MoE load, found ${n}:\n${all}")
endif()
foreach(line IN LISTS lines)
  string(REGEX REPLACE ".*moe load max/mean ([0-9.]+)$" "\\1" worst "${line}")
  message("${line}")
  if(worst GREATER ${BOUND})
    message(FATAL_ERROR "load max/mean ${worst} > ${BOUND}: ${line}\n${all}")
  endif()
endforeach()
