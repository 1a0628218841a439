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

/** Index of the largest value; the lowest index wins ties. NaN never wins. */
export function argmax (logits: Float32Array, offset = 0, length = logits.length - offset): number {
  let best = 0
  let bestValue = -Infinity
  for (let i = 0; i < length; i++) {
    const v = logits[offset + i]!
    if (v > bestValue) { bestValue = v; best = i }
  }
  return best
}

/**
 * Probabilities (float64) of the tokens kept by temperature and top-p, highest first (ties by
 * lower id), renormalised to sum to 1.
 */
export function nucleus (logits: Float32Array, params: SamplerParams, offset = 0, length = logits.length - offset): { ids: Int32Array, probs: Float64Array } {
  const inv = 1 / params.temperature
  let max = -Infinity
  for (let i = 0; i < length; i++) max = Math.max(max, logits[offset + i]! * inv)
  const p = new Float64Array(length)
  let sum = 0
  for (let i = 0; i < length; i++) { const e = Math.exp(logits[offset + i]! * inv - max); p[i] = e; sum += e }
  const order = Int32Array.from({ length }, (_, i) => i)
  order.sort((a, b) => (p[b]! - p[a]!) || (a - b))
  const topP = Math.min(1, Math.max(params.topP, 0))
  let kept = 0
  let mass = 0
  // Keep the smallest prefix whose mass reaches topP (at least one token).
  while (kept < length) {
    mass += p[order[kept]!]! / sum
    kept++
    if (mass >= topP - 1e-12) break
  }
  const ids = order.slice(0, kept)
  const probs = new Float64Array(kept)
  let keptSum = 0
  for (let i = 0; i < kept; i++) keptSum += p[ids[i]!]!
  for (let i = 0; i < kept; i++) probs[i] = p[ids[i]!]! / keptSum
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

/** Picks the next token from one row of logits with a draw made beforehand. */
export function pickToken (logits: Float32Array, pick: TokenPick, offset = 0, length = logits.length - offset): number {
  if (pick.temperature <= 0) return argmax(logits, offset, length)
  const { ids, probs } = nucleus(logits, pick, offset, length)
  const u = pick.u
  let acc = 0
  for (let i = 0; i < ids.length; i++) {
    acc += probs[i]!
    if (u < acc) return ids[i]!
  }
  return ids[ids.length - 1]!
}
