# Runs the codebook generator and fails unless its output equals the checked-in file.
execute_process(COMMAND ${GENERATOR} ${OUTPUT} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "codebook_gen failed with ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${OUTPUT} ${CHECKED_IN} RESULT_VARIABLE diff)
if(NOT diff EQUAL 0)
  message(FATAL_ERROR "kernels/codebooks.inc differs from a fresh run of codebook_gen "
                      "(${OUTPUT}); regenerate it with: build/tools/codebook_gen kernels/codebooks.inc")
endif()
message(STATUS "codebooks.inc matches the generator")
