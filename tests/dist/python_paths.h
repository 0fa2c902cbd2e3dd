#pragma once
// Where the tests that start Python ranks find Python: the interpreter the tdshm package was
// built for, the package's directory and tests/python (compile definitions from
// tests/CMakeLists.txt; empty without the Python package, and those tests skip).

#ifndef TDSHM_TEST_PYTHON
#define TDSHM_TEST_PYTHON ""
#endif
#ifndef TDSHM_TEST_PYTHON_DIR
#define TDSHM_TEST_PYTHON_DIR ""
#endif
#ifndef TDSHM_TEST_SCRIPTS
#define TDSHM_TEST_SCRIPTS ""
#endif
