# Makes <build>/python/prefire hold the package's Python files as they are in
# the source tree: copies what changed, and removes the .py/.pyi files and
# folders that are no longer in the source (a module moved or deleted must not
# stay importable from the build tree, where the tests import the package).
# What the build makes there (_C, _build.py) stays.
#   cmake -DSRC=<python/prefire> -DDST=<build>/python/prefire -P sync_package.cmake
file(GLOB_RECURSE _sources RELATIVE "${SRC}" "${SRC}/*.py" "${SRC}/*.pyi" "${SRC}/py.typed")
foreach(_file IN LISTS _sources)
  get_filename_component(_dir "${DST}/${_file}" DIRECTORY)
  file(MAKE_DIRECTORY "${_dir}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E copy_if_different "${SRC}/${_file}" "${DST}/${_file}")
endforeach()
file(GLOB_RECURSE _built RELATIVE "${DST}" "${DST}/*.py" "${DST}/*.pyi")
foreach(_file IN LISTS _built)
  if(NOT EXISTS "${SRC}/${_file}" AND NOT _file STREQUAL "_build.py")
    file(REMOVE "${DST}/${_file}")
  endif()
endforeach()
file(GLOB _folders LIST_DIRECTORIES true RELATIVE "${DST}" "${DST}/*")
foreach(_folder IN LISTS _folders)
  if(IS_DIRECTORY "${DST}/${_folder}" AND NOT IS_DIRECTORY "${SRC}/${_folder}")
    file(REMOVE_RECURSE "${DST}/${_folder}")
  endif()
endforeach()
