/**
 * Accepting drafted tokens against the target's own choices, so the output is exactly what the
 * target alone would produce:
 *  - greedy: a draft token stands while it equals the target's argmax at its position; the first
 *    mismatch is replaced by the target's argmax (the "bonus" token when all stand);
 *  - sampled (speculative sampling, Leviathan et al. / Chen et al.): draft token x drawn from q is
 *    accepted with probability min(1, p(x)/q(x)); on rejection the token is drawn from the residual
 *    max(0, p − q) normalised to sum 1. The accepted-or-resampled token is then distributed exactly
 *    as p. A drafter without a distribution (prompt lookup) is a point mass q = δ(x).
 * Pure functions over full-vocabulary probability rows; every random draw comes from the caller's
 * seeded generator, in a fixed order, so a seeded request reproduces.
 */
import { greedyVerdict, inverseCdf, nucleus } from '../engine/index.ts'
import type { Rng, SamplerParams } from '../engine/index.ts'

export interface Acceptance {
  /** Draft tokens accepted (a prefix of the proposal). */
  accepted: number
  /** The target's token after the accepted prefix (a correction, or the bonus when all stood). */
  next: number
}

/**
 * Greedy acceptance by id. `logits` holds rows [draft.length + 1, vocab]: row i is the target's
 * prediction after the context plus draft[0..i). The engine's (its worker checks a greedy verify
 * step the same way).
 */
export function acceptGreedy (draft: readonly number[], logits: Float32Array, vocab: number): Acceptance {
  return greedyVerdict(draft, logits, vocab)
}

/** The sampling distribution of one logits row over the whole vocabulary (temperature and top-p applied). */
export function distribution (logits: Float32Array, params: SamplerParams, offset: number, vocab: number): Float64Array {
  const { ids, probs } = nucleus(logits, params, offset, vocab)
  const out = new Float64Array(vocab)
  for (let i = 0; i < ids.length; i++) out[ids[i]!] = probs[i]!
  return out
}

/** Inverse-CDF draw from probabilities summing to 1: the first index whose cumulative mass exceeds u. */
export function sampleFrom (probs: Float64Array, u: number): number {
  return inverseCdf(probs, u)
}

/** max(0, p − q) normalised to sum 1 (p itself when the residual is empty, which only p = q allows). */
export function residual (p: Float64Array, q: Float64Array): Float64Array {
  const out = new Float64Array(p.length)
  let sum = 0
  for (let i = 0; i < p.length; i++) {
    const r = p[i]! - q[i]!
    if (r > 0) { out[i] = r; sum += r }
  }
  if (sum <= 0) return p
  for (let i = 0; i < out.length; i++) out[i] = out[i]! / sum
  return out
}

/**
 * Speculative sampling over one verified proposal. `p` has draft.length + 1 rows (the target's
 * distributions), `q` the draft's distribution for each drafted token, or undefined for a point
 * mass (a drafter that only names tokens). Draws: one per drafted token examined, then one for
 * the correction or bonus.
 */
export function acceptSampled (draft: readonly number[], p: readonly Float64Array[], q: ReadonlyArray<Float64Array> | undefined, rng: Rng): Acceptance {
  for (let i = 0; i < draft.length; i++) {
    const x = draft[i]!
    const pi = p[i]!
    const qx = q === undefined ? 1 : q[i]![x]!
    const px = pi[x]!
    const u = rng()
    // q(x) > 0 always holds for a token drawn from q; guard anyway so a bad drafter cannot divide by 0.
    if (qx > 0 && u < Math.min(1, px / qx)) continue
    const qi = q === undefined ? pointMass(x, pi.length) : q[i]!
    return { accepted: i, next: sampleFrom(residual(pi, qi), rng()) }
  }
  return { accepted: draft.length, next: sampleFrom(p[draft.length]!, rng()) }
}

function pointMass (x: number, vocab: number): Float64Array {
  const out = new Float64Array(vocab)
  out[x] = 1
  return out
}
