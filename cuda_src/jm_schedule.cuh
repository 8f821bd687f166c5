// jitmarlin — how the work of one GEMM is cut across CTAs ("stream-K" striping).
//
// The output is cut into units: (n tile of 64*nwarps columns) x (m tile of R rows); units are
// numbered u = n_tile * m_tiles + m_tile, so CTAs running side by side work on the same weight
// columns for different rows and the weights are reused from L2 when M is large. Each unit's K
// is cut into k_tiles tiles. All (unit, k tile) pairs are laid out in one line of length
// total = units * k_tiles and every CTA takes one contiguous run of `iters` of them (the striped
// partition of the Marlin paper, Frantar et al.): every SM gets the same amount of work for any
// shape, and a unit is split across as few CTAs as possible.
//
// A unit covered by one CTA is written directly. A unit covered by several CTAs ("split"): each
// of them stores its fp32 partial sums in a workspace region of its own (a CTA has at most two
// split units, its first and its last, so two regions per CTA), then bumps the unit's arrival
// counter; the last to arrive adds all partials in CTA order (deterministic), writes the output
// and resets the counter to zero, so the counters are all zero after every launch (CUDA-graph
// safe) and no CTA ever waits on another. The counter of a split unit is indexed by the CTA that
// holds the unit's first tile: that CTA's run contains the start of at most one split unit, so
// counter slots are unique and fewer than the grid size.
//
// All functions are host+device so that tests can check the partition on the CPU.
#pragma once

#include "jm_common.cuh"

namespace jm {

struct Schedule {
  int units;    // n_tiles * m_tiles
  int k_tiles;  // tiles along K per unit
  int total;    // units * k_tiles
  int iters;    // tiles per CTA (the last busy CTA may get fewer)
};

JM_HD Schedule make_schedule(int n_tiles, int m_tiles, int k_tiles, int grid) {
  Schedule s;
  s.units = n_tiles * m_tiles;
  s.k_tiles = k_tiles;
  s.total = s.units * k_tiles;
  s.iters = s.total > 0 ? ceil_div(s.total, grid) : 1;
  return s;
}

// The CTA whose run holds tile 0 of unit u: the unit's fixup slot.
JM_HD int unit_slot(const Schedule& s, int u) { return (u * s.k_tiles) / s.iters; }

// How many CTAs work on unit u (1: no fixup needed).
JM_HD int unit_ctas(const Schedule& s, int u) {
  const int first = (u * s.k_tiles) / s.iters;
  const int last = ((u + 1) * s.k_tiles - 1) / s.iters;
  return last - first + 1;
}

}  // namespace jm
