/* The library under test of the ABI callers (see tests/CMakeLists.txt): a static libkda linked whole
 * into a loadable module. This file only gives the module a source of its own; it defines nothing. */
typedef int kda_abi_module_defines_nothing;
