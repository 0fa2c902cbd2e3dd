// transfer: see include/tdshm/distributed.h (work in progress).

#include <tdshm/distributed.h>
