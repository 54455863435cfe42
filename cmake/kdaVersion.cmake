# kda's version has one source, the VERSION file at the top of the source tree ("MAJOR.MINOR.PATCH"):
# CMakeLists.txt reads it here before project(), pyproject.toml reads it for the Python package, and
# the C header's KDA_VERSION_* macros are generated from it (kda/version.h).
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/../VERSION" KDA_VERSION LIMIT_COUNT 1
     REGEX "^[0-9]+\\.[0-9]+\\.[0-9]+$")
if(NOT KDA_VERSION)
  message(FATAL_ERROR "VERSION must hold the version as MAJOR.MINOR.PATCH on its first line")
endif()
# Editing VERSION reconfigures the build.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${CMAKE_CURRENT_LIST_DIR}/../VERSION")

# Generates kda/version.h into the build tree, puts it on TARGET's public include path and installs it
# next to kda.h, so both the build tree and an installed kda see the same macros.
function(kda_version_header target)
  include(GNUInstallDirs)
  set(dir "${PROJECT_BINARY_DIR}/generated/include")
  configure_file("${PROJECT_SOURCE_DIR}/cmake/version.h.in" "${dir}/kda/version.h" @ONLY)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${dir}>)
  install(FILES "${dir}/kda/version.h" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kda)
endfunction()
