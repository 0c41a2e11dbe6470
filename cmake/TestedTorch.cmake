# The torch releases prefire is tested against (cmake/torch-releases.txt, the
# list CI builds and tests each of), and a warning when this build's torch is
# outside their range.
#
# Input:  PREFIRE_TORCH_RELEASE (cmake/FindTorchFromPython.cmake)
# Output: PREFIRE_TESTED_TORCH_RELEASES - every listed release, oldest first (2.11.0;2.14.1;2.15.0)
#         PREFIRE_TESTED_TORCH_LOW, _HIGH - the range's ends as major.minor (2.11, 2.15)
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/torch-releases.txt" _prefire_release_lines REGEX "^[0-9]")
set(PREFIRE_TESTED_TORCH_RELEASES "")
foreach(_line IN LISTS _prefire_release_lines)
  string(REGEX MATCH "^[0-9.]+" _release "${_line}")
  list(APPEND PREFIRE_TESTED_TORCH_RELEASES "${_release}")
endforeach()
list(GET PREFIRE_TESTED_TORCH_RELEASES 0 _prefire_oldest)
list(GET PREFIRE_TESTED_TORCH_RELEASES -1 _prefire_newest)
string(REGEX MATCH "^[0-9]+\\.[0-9]+" PREFIRE_TESTED_TORCH_LOW "${_prefire_oldest}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" PREFIRE_TESTED_TORCH_HIGH "${_prefire_newest}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _prefire_this "${PREFIRE_TORCH_RELEASE}")
if(_prefire_this VERSION_LESS PREFIRE_TESTED_TORCH_LOW OR _prefire_this VERSION_GREATER PREFIRE_TESTED_TORCH_HIGH)
  message(WARNING "prefire is tested with torch ${PREFIRE_TESTED_TORCH_LOW} to ${PREFIRE_TESTED_TORCH_HIGH} "
                  "(CI: ${PREFIRE_TESTED_TORCH_RELEASES}); this build's torch is ${PREFIRE_TORCH_RELEASE}. "
                  "It may not compile, and `import prefire` will warn.")
endif()
