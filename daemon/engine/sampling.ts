/**
 * Token sampling: pure functions over one row of logits. Greedy when temperature is 0 (ties go to
 * the lowest id), otherwise softmax(logits / T) restricted to the top-p nucleus, drawn with a
 * seeded PRNG so the same seed gives the same tokens.
 */
import { randomBytes } from 'node:crypto'

export interface SamplerParams {
  /** 0 means greedy. */
  temperature: number
  /** Nucleus mass in (0, 1]; 1 keeps every token. */
  topP: number
}

/** A uniform [0, 1) source. */
export type Rng = () => number

/**
 * SplitMix32-style generator (Mulberry32): 32-bit state, full period, good enough for sampling,
 * and identical everywhere, so a seed reproduces a generation across machines.
 */
export function createRng (seed?: number): Rng {
  let state = seed === undefined ? randomBytes(4).readUInt32LE(0) : (Math.trunc(seed) >>> 0) ^ Math.trunc(seed / 2 ** 32)
  return () => {
    state = (state + 0x6d2b79f5) >>> 0
    let t = state
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 2 ** 32
  }
}

/**
 * Index of the largest value; the lowest index wins ties. The token onnxruntime's TopK (k = 1)
 * gives, which a greedy step whose rows are all greedy takes from the graph (and GreedyHead from
 * its kernel): a scan from index 0 that moves only to a larger value, so a NaN after index 0 never
 * wins and a NaN at index 0 is never left (a row of nothing but NaN and −∞ gives 0). So a greedy
 * row's token does not depend on whether its batch fetched the logits (a sampled row beside it, a
 * verify step). Four running maxima first, then the first index holding the maximum: about twice
 * as fast as one compare-and-remember loop over a 32k vocabulary (it runs once per token per row).
 */
export function argmax (logits: Float32Array, offset = 0, length = logits.length - offset): number {
  if (Number.isNaN(logits[offset])) return 0
  const m = maxOf(logits, offset, length)
  if (m === -Infinity) return 0
  const end = offset + length
  for (let i = offset; i < end; i++) if (logits[i] === m) return i - offset
  return 0
}

/**
 * What temperature and top-p keep of one row: `w[i]` = exp(logit_i / T − max) for a kept token, 0
 * for a dropped one, and `sum` their total (added in id order). In O(V): no sort of the vocabulary
 * (sorting 32k ids cost ~17 ms a token).
 */
function keptWeights (logits: Float32Array, params: SamplerParams, offset: number, length: number): { w: Float64Array, sum: number } {
  if (params.topP >= 1) {
    const { z, max } = scaledLogits(logits, 1 / params.temperature, offset, length)
    const w = scratch(0, length)
    let total = 0
    for (let i = 0; i < length; i++) { const e = Math.exp(z[i]! - max); w[i] = e; total += e }
    return { w, sum: total }
  }
  const plan = nucleusPlan(logits, params, offset, length)
  const { w, cell, cross, cut } = plan
  if (!(plan.total > 0)) return { w, sum: plan.total }
  let sum = 0
  for (let i = 0; i < length; i++) {
    const c = cell[i]!
    if (c < cross || (c === cross && cut[i] === 1)) sum += w[i]!
    else w[i] = 0
  }
  return { w, sum }
}

/**
 * Top-p < 1: the smallest set of the most likely tokens whose mass reaches p (equal probabilities:
 * lower ids first), as a plan instead of a mask: the weights' pass also sums them by cells of
 * 1/16 nat below the maximum (as drawFromCells) and records each token's cell; a token is kept
 * when its cell is above `cross` (cells kept whole from the top while the mass stays short of p)
 * or it is flagged in `cut` (the crossing cell, cut by nucleusCut). `keptMass`: their total, by
 * cells. `total`: every weight's, in id order.
 */
interface NucleusPlan { w: Float64Array, cell: Uint16Array, cross: number, cut: Uint8Array, keptMass: number, total: number }

function nucleusPlan (logits: Float32Array, params: SamplerParams, offset: number, length: number): NucleusPlan {
  const { z, max } = scaledLogits(logits, 1 / params.temperature, offset, length)
  const w = scratch(0, length)
  const cell = cellScratch(length)
  const cellMass = new Float64Array(CELLS)
  let total = 0
  for (let i = 0; i < length; i++) {
    const e = Math.exp(z[i]! - max)
    w[i] = e
    total += e
    const c = cellOf((max - z[i]!) * CELLS_PER_NAT)
    cell[i] = c
    cellMass[c] = cellMass[c]! + e
  }
  const cut = new Uint8Array(length)
  const topP = Math.max(params.topP, 0)
  if (!(total > 0)) return { w, cell, cross: -1, cut, keptMass: 0, total }
  const target = topP * total
  let mass = 0
  let cross = 0
  while (cross < CELLS - 1 && mass + cellMass[cross]! < target) mass += cellMass[cross++]!
  // The crossing cell's members with any weight, in increasing id order: one scan of the cells
  // (chaining every token to its cell in the pass above cost more than this).
  const members = indexScratch(length)
  let n = 0
  for (let i = 0; i < length; i++) if (cell[i] === cross && w[i]! > 0) members[n++] = i
  const keptMass = nucleusCut(w, z, members.subarray(0, n), mass, target, cut)
  return { w, cell, cross, cut, keptMass, total }
}

/** logit · inv for each token of the row (scratch row 1) and the largest of them. */
function scaledLogits (logits: Float32Array, inv: number, offset: number, length: number): { z: Float64Array, max: number } {
  const z = scratch(1, length)
  for (let i = 0; i < length; i++) z[i] = logits[offset + i]! * inv
  // inv > 0 and rounding is monotone, so the largest product is the largest logit's: maxOf's four
  // running maxima instead of a compare-and-remember chain in the loop above.
  return { z, max: maxOf(logits, offset, length) * inv }
}

/** The cell of a token `d` sixteenths of a nat below the maximum (d ≥ 0; NaN and everything past 32 nats: the last). */
function cellOf (d: number): number {
  // d ≥ 0, so truncation is the floor.
  return d < CELLS - 1 ? d | 0 : CELLS - 1
}

/** Grow-only float64 rows reused from pick to pick (a 32k row is 256 KB; one per token was garbage). */
const scratchRows: Float64Array[] = []
function scratch (slot: number, length: number): Float64Array {
  let row = scratchRows[slot]
  if (row === undefined || row.length < length) { row = new Float64Array(length); scratchRows[slot] = row }
  return row.subarray(0, length)
}

const CUT_BUCKETS = 64
const CUT_SORT_BELOW = 256

/**
 * Flags (1) in `keep` the smallest set of the largest weights among `candidates` (indices in
 * increasing order, all with w > 0) that brings `mass` to `target`, ties by lower index, and
 * returns the mass reached: the candidates are bucketed by log-weight (`lw`: the scaled logits,
 * w = exp(lw − max), the same order) between their largest and smallest, buckets taken whole from
 * the top while the mass stays short of the target, and the one bucket where it crosses becomes
 * the new candidates (always fewer: the largest and the smallest fall in different buckets) —
 * until few enough to sort, or all equal (then in index order).
 */
function nucleusCut (w: Float64Array, lw: Float64Array, candidates: Int32Array, mass: number, target: number, keep: Uint8Array): number {
  let count = candidates.length
  const bucketMass = new Float64Array(CUT_BUCKETS)
  const bucketCount = new Int32Array(CUT_BUCKETS)
  for (;;) {
    if (count <= CUT_SORT_BELOW) {
      const order = Array.from(candidates.subarray(0, count)).sort((a, b) => (w[b]! - w[a]!) || (a - b))
      for (const i of order) {
        keep[i] = 1
        mass += w[i]!
        if (mass >= target) break
      }
      return mass
    }
    let hi = -Infinity
    let lo = Infinity
    for (let k = 0; k < count; k++) { const z = lw[candidates[k]!]!; if (z > hi) hi = z; if (z < lo) lo = z }
    if (!(hi > lo)) {
      // All equal: lower indices first.
      for (let k = 0; k < count; k++) {
        const i = candidates[k]!
        keep[i] = 1
        mass += w[i]!
        if (mass >= target) break
      }
      return mass
    }
    const scale = CUT_BUCKETS / (hi - lo)
    bucketMass.fill(0)
    bucketCount.fill(0)
    for (let k = 0; k < count; k++) {
      const i = candidates[k]!
      const b = Math.min(CUT_BUCKETS - 1, Math.floor((hi - lw[i]!) * scale))
      bucketMass[b] = bucketMass[b]! + w[i]!
      bucketCount[b] = bucketCount[b]! + 1
    }
    let cross = 0
    while (cross < CUT_BUCKETS - 1 && mass + bucketMass[cross]! < target) mass += bucketMass[cross++]!
    // The crossing bucket's members, in index order, replace the candidates (in place: n ≤ k).
    let n = 0
    for (let k = 0; k < count; k++) {
      const i = candidates[k]!
      const b = Math.min(CUT_BUCKETS - 1, Math.floor((hi - lw[i]!) * scale))
      if (b < cross) keep[i] = 1
      else if (b === cross) candidates[n++] = i
    }
    count = n
  }
}

/**
 * Probabilities (float64) of the tokens kept by temperature and top-p, in id order, renormalised
 * to sum to 1 (speculative verification's distributions).
 */
export function nucleus (logits: Float32Array, params: SamplerParams, offset = 0, length = logits.length - offset): { ids: Int32Array, probs: Float64Array } {
  const { w, sum } = keptWeights(logits, params, offset, length)
  let kept = 0
  for (let i = 0; i < length; i++) if (w[i]! > 0) kept++
  const ids = new Int32Array(kept)
  const probs = new Float64Array(kept)
  for (let i = 0, k = 0; i < length; i++) {
    if (w[i]! > 0) { ids[k] = i; probs[k++] = w[i]! / sum }
  }
  return { ids, probs }
}

/**
 * A token choice made where the logits are (the engine worker), with the random draw `u` made by
 * the sequence's own seeded generator beforehand: only a token id crosses back, and the tokens are
 * exactly those sampleToken would give (greedy ignores `u`).
 */
export interface TokenPick extends SamplerParams {
  /** Uniform in [0, 1); unused when temperature is 0. */
  u: number
}

/** The greedy pick (argmax), for callers that always decode greedily: drafts, benchmarks, tests. */
export const GREEDY_PICK: Readonly<TokenPick> = Object.freeze({ temperature: 0, topP: 1, u: 0 })

/** The TokenPick for the next step: draws from `rng` only when sampling needs it, as sampleToken does. */
export function nextPick (params: SamplerParams, rng: Rng): TokenPick {
  return { temperature: params.temperature, topP: params.topP, u: params.temperature <= 0 ? 0 : rng() }
}

/** Picks the next token from one row of logits. */
export function sampleToken (logits: Float32Array, params: SamplerParams, rng: Rng, offset = 0, length = logits.length - offset): number {
  return pickToken(logits, nextPick(params, rng), offset, length)
}

/** A pick that takes the largest logit (argmax; a graph's greedy_token gives the same token). */
export const isGreedy = (pick: TokenPick | undefined): boolean => pick !== undefined && pick.temperature <= 0

/**
 * Picks the next token from one row of logits with a draw made beforehand: greedy; over the whole
 * vocabulary (top-p 1, the OpenAI default) by drawFromCells; with top-p < 1 by drawNucleus. Each is
 * an exact draw from the distribution, and a function of (logits, params, u) alone, so a seed
 * reproduces.
 */
export function pickToken (logits: Float32Array, pick: TokenPick, offset = 0, length = logits.length - offset): number {
  if (isGreedy(pick)) return argmax(logits, offset, length)
  if (pick.topP >= 1) return drawFromCells(logits, 1 / pick.temperature, offset, length, pick.u)
  return drawNucleus(logits, pick, offset, length, pick.u)
}

/** The inverse-CDF walk in id order over what keptWeights keeps (top-p < 1: over the plan, one pass). */
function drawByWalk (logits: Float32Array, params: SamplerParams, offset: number, length: number, u: number): number {
  if (params.topP >= 1) {
    const { w, sum } = keptWeights(logits, params, offset, length)
    if (!(sum > 0)) return argmax(logits, offset, length)
    return inverseCdf(w, u * sum, length)
  }
  const { w, cell, cross, cut, keptMass } = nucleusPlan(logits, params, offset, length)
  if (!(keptMass > 0)) return argmax(logits, offset, length)
  const target = u * keptMass
  // inverseCdf's walk with the plan's kept test inlined (a callback per token would cost more
  // than the zeroing pass it replaces).
  let acc = 0
  let last = 0
  for (let i = 0; i < length; i++) {
    const c = cell[i]!
    if (c > cross || (c === cross && cut[i] !== 1)) continue
    const p = w[i]!
    if (p <= 0) continue
    last = i
    acc += p
    if (target < acc) return i
  }
  // keptMass was added by cells, the walk in id order: rounding can leave the target just above.
  return last
}

/**
 * Inverse-CDF draw over weights in index order: the first index whose cumulative weight exceeds
 * `target` (u times the total), or the last non-zero one if rounding leaves the target above it.
 */
export function inverseCdf (weights: Float64Array, target: number, length = weights.length): number {
  let acc = 0
  let last = 0
  for (let i = 0; i < length; i++) {
    const p = weights[i]!
    if (p <= 0) continue
    last = i
    acc += p
    if (target < acc) return i
  }
  return last
}

const CELLS_PER_NAT = 16
/** 32 nats below the maximum; everything lower (weights under e^−32) shares the last cell. */
const CELLS = 512
const CELL_BOUND = Float64Array.from({ length: CELLS }, (_, c) => Math.exp(-c / CELLS_PER_NAT))
const MAX_TRIES = 64

/**
 * An exact draw from softmax(logits · inv) with about one exp instead of one per token (the exp
 * pass was ~0.45 ms of a 32k row, per sampled row per step). Rejection sampling: token i, at
 * gap g_i = (max logit − logit_i) · inv, falls in cell c = ⌊16 g_i⌋ (the last cell holds the
 * rest), whose bound b_c = e^(−c/16) ≥ e^(−g_i); a token is proposed with probability
 * b_c / Σ bounds (a cell by its bound mass, then uniformly within it) and accepted with
 * probability e^(−g_i) / b_c ≥ e^(−1/16), so what comes out is proportional to e^(−g_i), exactly.
 * The uniforms after `u` come from a generator seeded by u's bits: the draw is a function of u.
 * After MAX_TRIES rejections (probability < 10⁻⁷⁰) the walk over every weight decides.
 */
function drawFromCells (logits: Float32Array, inv: number, offset: number, length: number, u: number): number {
  const top = maxOf(logits, offset, length)
  // Nothing finite to weigh (all −∞ or NaN), or a +∞ logit: greedy decides.
  if (!(top > -Infinity) || top === Infinity) return argmax(logits, offset, length)
  // gap_i = (top − logit_i) / T ≥ 0 decides both the cell and the acceptance, so they agree.
  const scale = inv * CELLS_PER_NAT
  const count = cellCounts(logits, top, scale, offset, length)
  let bound = 0
  for (let c = 0; c < CELLS; c++) bound += count[c]! * CELL_BOUND[c]!
  const rng = createRng(Math.floor(u * 2 ** 32))
  for (let t = 0; t < MAX_TRIES; t++) {
    let target = rng() * bound
    let c = 0
    for (; c < CELLS - 1; c++) {
      const m = count[c]! * CELL_BOUND[c]!
      if (target < m) break
      target -= m
    }
    const n = count[c]!
    if (n === 0) continue
    // What is left of the target is uniform over the cell's n equal bounds: it names the member,
    // counted from the highest id down (one scan that stops there: ~a quarter of the pass that
    // chained every token to its cell, which is what it replaced; the same member, so a seed
    // draws the same tokens).
    let k = Math.min(n - 1, Math.floor(target / CELL_BOUND[c]!))
    let i = offset + length - 1
    for (; i > offset; i--) {
      const d = (top - logits[i]!) * scale
      if ((d < CELLS - 1 ? d | 0 : CELLS - 1) === c && k-- === 0) break
    }
    // NaN falls in the last cell and is never accepted (the comparison is false).
    if (rng() * CELL_BOUND[c]! < Math.exp((logits[i]! - top) * inv)) return i - offset
  }
  return drawByWalk(logits, { temperature: 1 / inv, topP: 1 }, offset, length, u)
}

/*
 * Top-p < 1 (drawNucleus): cells of 1/64 nat of the nucleus's own gaps (max − z, as nucleusPlan
 * computes them), 32 nats deep, the last holding the rest. FINE_HIGH[c] = e^(−c/64): no weight in
 * cell c is larger; FINE_LOW[c] = e^(−(c+1)/64): none is smaller (0 for the last cell).
 */
const FINE_PER_NAT = 64
const FINE = 2048
const FINE_HIGH = Float64Array.from({ length: FINE }, (_, c) => Math.exp(-c / FINE_PER_NAT))
const FINE_LOW = Float64Array.from({ length: FINE }, (_, c) => c === FINE - 1 ? 0 : Math.exp(-(c + 1) / FINE_PER_NAT))
/**
 * Relative room a decision by bounds keeps for rounding: exp's and the bounds' own (ulps), and
 * the float sums nucleusPlan compares, in other orders (≤ n·2⁻⁵³ of the total, ~4·10⁻¹² at 32k).
 */
const SLACK = 1e-9
/** Below this top-p a draw could take more than four proposals on average: the walk decides. */
const NUCLEUS_TOP_P_MIN = 0.25
const NUCLEUS_TRIES = 256
const fineLow = new Float64Array(FINE + 1)
const fineHigh = new Float64Array(FINE + 1)

/**
 * An exact draw from the nucleus (top-p < 1) without a weight for every token (nucleusPlan's exp
 * for each of 32k tokens, its cells and cut took ~0.5–1 ms a row, per sampled row per step):
 * draws from the whole softmax by rejection (as drawFromCells, over the fine cells), each kept
 * only if it is in the nucleus, which gives the nucleus's own distribution (renormalised), exactly.
 * A token is in the nucleus when the weight ranked above it is short of p · total (nucleusPlan's
 * definition). From the cells' counts alone both are intervals: every token two cells or more
 * above the proposed one's ranks above it, and none two or more below, and each cell's mass lies
 * within its count times its bounds (1/64 nat apart: ~1.6 %). Decided by them when clear of p ·
 * total by more than rounding; otherwise (a few % of proposals) by nucleusPlan itself, made once
 * for the row. So the kept set is nucleusPlan's, token for token. Proposals are accepted with
 * probability ≥ p, so it needs p ≥ NUCLEUS_TOP_P_MIN; a row with NaN, or without a finite
 * maximum, goes to the walk, which decides such rows (argmax). The uniforms after `u` come from a
 * generator seeded by u's bits: the draw is a function of u.
 */
function drawNucleus (logits: Float32Array, params: SamplerParams, offset: number, length: number, u: number): number {
  const inv = 1 / params.temperature
  const top = maxOf(logits, offset, length)
  const max = top * inv
  if (!(params.topP >= NUCLEUS_TOP_P_MIN) || !Number.isFinite(max)) return drawByWalk(logits, params, offset, length, u)
  const counts = fineCounts(logits, max, inv, offset, length)
  if (counts === undefined) return drawByWalk(logits, params, offset, length, u)
  let low = 0
  let high = 0
  for (let c = 0; c < FINE; c++) {
    low += counts[c]! * FINE_LOW[c]!
    high += counts[c]! * FINE_HIGH[c]!
    fineLow[c + 1] = low
    fineHigh[c + 1] = high
  }
  // The weight ranked above a kept token is below p · total, at least p · low; a dropped one's at
  // least p · total, at most p · high.
  const surelyIn = params.topP * low * (1 - SLACK)
  const surelyOut = params.topP * high * (1 + SLACK)
  const rng = createRng(Math.floor(u * 2 ** 32))
  let plan: NucleusPlan | undefined
  for (let t = 0; t < NUCLEUS_TRIES; t++) {
    const i = proposeFine(logits, max, inv, offset, length, counts, rng)
    if (i < 0) continue
    const c = fineCell(logits[offset + i]!, max, inv)
    // Above it: at most the cells down to the one below its own, less its own bound.
    if ((fineHigh[Math.min(FINE, c + 2)]! - FINE_HIGH[c]!) * (1 + SLACK) < surelyIn) return i
    if (fineLow[Math.max(0, c - 1)]! * (1 - SLACK) > surelyOut) continue
    plan ??= nucleusPlan(logits, params, offset, length)
    if (plan.w[i]! > 0 && (plan.cell[i]! < plan.cross || (plan.cell[i] === plan.cross && plan.cut[i] === 1))) return i
  }
  return drawByWalk(logits, params, offset, length, u)
}

/** A token's fine cell: its gap max − logit · inv (nucleusPlan's, bit for bit) in 64ths of a nat; NaN and past 32 nats: the last. */
function fineCell (logit: number, max: number, inv: number): number {
  const d = (max - logit * inv) * FINE_PER_NAT
  return d < FINE - 1 ? d | 0 : FINE - 1
}

/**
 * One proposal from the whole softmax over the fine cells (the same scheme as drawFromCells): a
 * cell by its bound mass, a member uniformly (counted from the highest id down), accepted with
 * probability w / bound. The token (relative to offset), or −1 when rejected.
 */
function proposeFine (logits: Float32Array, max: number, inv: number, offset: number, length: number, counts: Int32Array, rng: Rng): number {
  const target = rng() * fineHigh[FINE]!
  // The cell: the first whose cumulative bound mass passes the target.
  let lo = 0
  let hi = FINE - 1
  while (lo < hi) {
    const mid = (lo + hi) >> 1
    if (fineHigh[mid + 1]! > target) hi = mid
    else lo = mid + 1
  }
  const c = lo
  const n = counts[c]!
  if (n === 0) return -1
  let k = Math.min(n - 1, Math.floor((target - fineHigh[c]!) / FINE_HIGH[c]!))
  let i = offset + length - 1
  for (; i > offset; i--) if (fineCell(logits[i]!, max, inv) === c && k-- === 0) break
  // The weight as nucleusPlan computes it: exp(z − max).
  return rng() * FINE_HIGH[c]! < Math.exp(logits[i]! * inv - max) ? i - offset : -1
}

const fine0 = new Int32Array(FINE)
const fine1 = new Int32Array(FINE)
const fine2 = new Int32Array(FINE)
const fine3 = new Int32Array(FINE)

/**
 * How many tokens of the row fall in each fine cell (four histograms, as cellCounts), or undefined
 * when the row holds a NaN (with a finite maximum, the only way the logits' sum is NaN). Returns
 * fine0, valid until the next call. Written apart from cellCounts on purpose: one histogram for
 * both (the gap's formula and the lanes as arguments, the NaN test a pass of its own) made the
 * top-p 1 draw 10–28 % slower and this one 5–40 % (one process, the two alternating, wave 42).
 */
function fineCounts (logits: Float32Array, max: number, inv: number, offset: number, length: number): Int32Array | undefined {
  fine0.fill(0)
  fine1.fill(0)
  fine2.fill(0)
  fine3.fill(0)
  const last = FINE - 1
  const end = offset + length
  const end4 = end - (length & 3)
  let s0 = 0
  let s1 = 0
  for (let i = offset; i < end4; i += 4) {
    const la = logits[i]!
    const lb = logits[i + 1]!
    const lc = logits[i + 2]!
    const ld = logits[i + 3]!
    s0 += la + lb
    s1 += lc + ld
    const a = (max - la * inv) * FINE_PER_NAT
    const b = (max - lb * inv) * FINE_PER_NAT
    const c = (max - lc * inv) * FINE_PER_NAT
    const d = (max - ld * inv) * FINE_PER_NAT
    fine0[a < last ? a | 0 : last]!++
    fine1[b < last ? b | 0 : last]!++
    fine2[c < last ? c | 0 : last]!++
    fine3[d < last ? d | 0 : last]!++
  }
  for (let i = end4; i < end; i++) { s0 += logits[i]!; fine0[fineCell(logits[i]!, max, inv)]!++ }
  if (Number.isNaN(s0 + s1)) return undefined
  for (let c = 0; c < FINE; c++) fine0[c] = fine0[c]! + fine1[c]! + fine2[c]! + fine3[c]!
  return fine0
}

const lane0 = new Int32Array(CELLS)
const lane1 = new Int32Array(CELLS)
const lane2 = new Int32Array(CELLS)
const lane3 = new Int32Array(CELLS)

/**
 * How many tokens of the row fall in each cell (cellOf((top − logit) · scale)). Four histograms,
 * summed at the end, and the cell computed inline: consecutive increments of one counter stall
 * the CPU on the store before them (a 32k row took ~390 µs that way, ~45–65 µs like this).
 * Returns lane0, valid until the next call.
 */
function cellCounts (logits: Float32Array, top: number, scale: number, offset: number, length: number): Int32Array {
  lane0.fill(0)
  lane1.fill(0)
  lane2.fill(0)
  lane3.fill(0)
  const last = CELLS - 1
  const end = offset + length
  const end4 = end - (length & 3)
  for (let i = offset; i < end4; i += 4) {
    const a = (top - logits[i]!) * scale
    const b = (top - logits[i + 1]!) * scale
    const c = (top - logits[i + 2]!) * scale
    const d = (top - logits[i + 3]!) * scale
    lane0[a < last ? a | 0 : last]!++
    lane1[b < last ? b | 0 : last]!++
    lane2[c < last ? c | 0 : last]!++
    lane3[d < last ? d | 0 : last]!++
  }
  for (let i = end4; i < end; i++) lane0[cellOf((top - logits[i]!) * scale)]!++
  for (let c = 0; c < CELLS; c++) lane0[c] = lane0[c]! + lane1[c]! + lane2[c]! + lane3[c]!
  return lane0
}

/** The largest value of a row (NaN never; −∞ for a row of nothing else), by four running maxima. */
function maxOf (logits: Float32Array, offset: number, length: number): number {
  const end = offset + length
  const end4 = offset + length - (length & 3)
  let m0 = -Infinity
  let m1 = -Infinity
  let m2 = -Infinity
  let m3 = -Infinity
  for (let i = offset; i < end4; i += 4) {
    const a = logits[i]!
    const b = logits[i + 1]!
    const c = logits[i + 2]!
    const d = logits[i + 3]!
    if (a > m0) m0 = a
    if (b > m1) m1 = b
    if (c > m2) m2 = c
    if (d > m3) m3 = d
  }
  let m = m0 > m1 ? m0 : m1
  if (m2 > m) m = m2
  if (m3 > m) m = m3
  for (let i = end4; i < end; i++) if (logits[i]! > m) m = logits[i]!
  return m
}

let indices = new Int32Array(0)
function indexScratch (length: number): Int32Array {
  if (indices.length < length) indices = new Int32Array(length)
  return indices
}

let cells = new Uint16Array(0)
function cellScratch (length: number): Uint16Array {
  if (cells.length < length) cells = new Uint16Array(length)
  return cells
}
