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
 * Index of the largest value; the lowest index wins ties. NaN never wins (a row of nothing but NaN
 * and −∞ gives 0). Four running maxima first, then the first index holding the maximum: about twice
 * as fast as one compare-and-remember loop over a 32k vocabulary (it runs once per token per row).
 */
export function argmax (logits: Float32Array, offset = 0, length = logits.length - offset): number {
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
  if (m === -Infinity) return 0
  for (let i = offset; i < end; i++) if (logits[i] === m) return i - offset
  return 0
}

/**
 * What temperature and top-p keep of one row: `w[i]` = exp(logit_i / T − max) for a kept token, 0
 * for a dropped one, and `sum` their total (added in id order). In O(V): no sort of the vocabulary
 * (sorting 32k ids cost ~17 ms a token). Top-p keeps the smallest set of the most likely tokens whose
 * mass reaches p (equal probabilities: lower ids first), found by bucketing the candidates by
 * log-probability and descending into the one bucket where the mass crosses p (nucleusCut).
 */
function keptWeights (logits: Float32Array, params: SamplerParams, offset: number, length: number): { w: Float64Array, sum: number } {
  const inv = 1 / params.temperature
  const z = scratch(1, length)
  let max = -Infinity
  for (let i = 0; i < length; i++) { const v = logits[offset + i]! * inv; z[i] = v; if (v > max) max = v }
  const w = scratch(0, length)
  let total = 0
  for (let i = 0; i < length; i++) { const e = Math.exp(z[i]! - max); w[i] = e; total += e }
  const topP = Math.min(1, Math.max(params.topP, 0))
  if (!(total > 0) || topP >= 1) return { w, sum: total }
  const keep = nucleusCut(w, z, length, topP * total)
  let sum = 0
  for (let i = 0; i < length; i++) {
    if (keep[i] === 1) sum += w[i]!
    else w[i] = 0
  }
  return { w, sum }
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
 * Flags (1) the smallest set of the largest of w[0, length) whose total reaches `target`, ties by
 * lower index: candidates are bucketed by log-weight (`lw`: the scaled logits, w = exp(lw − max),
 * the same order) between their largest and smallest, buckets
 * taken whole from the top while the mass stays short of the target, and the one bucket where it
 * crosses becomes the new candidates (always fewer: the largest and the smallest fall in
 * different buckets) — until few enough to sort, or all equal (then in index order, which
 * candidates keep).
 */
function nucleusCut (w: Float64Array, lw: Float64Array, length: number, target: number): Uint8Array {
  const keep = new Uint8Array(length)
  // Zero weights (underflowed) add no mass: never candidates.
  let candidates = new Int32Array(length)
  let count = 0
  for (let i = 0; i < length; i++) if (w[i]! > 0) candidates[count++] = i
  const bucketMass = new Float64Array(CUT_BUCKETS)
  const bucketCount = new Int32Array(CUT_BUCKETS)
  let mass = 0
  for (;;) {
    if (count <= CUT_SORT_BELOW) {
      const order = Array.from(candidates.subarray(0, count)).sort((a, b) => (w[b]! - w[a]!) || (a - b))
      for (const i of order) {
        keep[i] = 1
        mass += w[i]!
        if (mass >= target) break
      }
      return keep
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
      return keep
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
    candidates = candidates.subarray(0, count)
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

/** The TokenPick for the next step: draws from `rng` only when sampling needs it, as sampleToken does. */
export function nextPick (params: SamplerParams, rng: Rng): TokenPick {
  return { temperature: params.temperature, topP: params.topP, u: params.temperature <= 0 ? 0 : rng() }
}

/** Picks the next token from one row of logits. */
export function sampleToken (logits: Float32Array, params: SamplerParams, rng: Rng, offset = 0, length = logits.length - offset): number {
  return pickToken(logits, nextPick(params, rng), offset, length)
}

/**
 * Picks the next token from one row of logits with a draw made beforehand: greedy, or the first
 * kept token in id order whose cumulative weight exceeds u · (kept total) — an exact draw from the
 * nucleus distribution.
 */
export function pickToken (logits: Float32Array, pick: TokenPick, offset = 0, length = logits.length - offset): number {
  if (pick.temperature <= 0) return argmax(logits, offset, length)
  const { w, sum } = keptWeights(logits, pick, offset, length)
  if (!(sum > 0)) return argmax(logits, offset, length)
  const target = pick.u * sum
  let acc = 0
  let last = 0
  for (let i = 0; i < length; i++) {
    const p = w[i]!
    if (p <= 0) continue
    last = i
    acc += p
    if (target < acc) return i
  }
  return last
}
