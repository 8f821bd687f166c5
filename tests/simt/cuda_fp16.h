// Stand-in for CUDA's header under the SIMT emulator: the types come from simt.h.
#pragma once
#include "simt.h"
