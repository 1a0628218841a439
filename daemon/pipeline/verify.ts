/**
 * The last stage's check of a verify activation's drafts (speculative decoding across a chain),
 * with only token ids from the coordinator — no draft distributions travel:
 *  - greedy: drafts stand while they equal this model's argmax; then its argmax;
 *  - sampled: each draft x is treated as a point mass, accepted with probability p(x), and on
 *    rejection the token is drawn from p without x, renormalised; after every draft stood, from
 *    p itself. Whatever chose x, the token is then distributed exactly as p (P(x) = p(x), and
 *    P(y) = (1 − p(x)) · p(y) / (1 − p(x)) for y ≠ x). Draws come from the request's seeded
 *    generator on this stage: one per draft examined, one for the token after them.
 */
import { greedyVerdict, nucleus, pickToken } from '../engine/index.ts'
import type { Rng, SamplerParams } from '../engine/index.ts'

export interface Verdict {
  accepted: number
  tokenId: number
  /** Random draws made (for a replay's rngSkip). */
  draws: number
}

/** `logits`: rows [drafts.length + 1, vocab]; row i predicts the token after the token and drafts[0..i). */
export function checkDrafts (logits: Float32Array, vocab: number, drafts: readonly number[], sampling: SamplerParams, rng: Rng): Verdict {
  if (sampling.temperature <= 0) {
    // The engine's own rule (its worker checks a whole model's greedy verify the same way).
    const { accepted, next } = greedyVerdict(drafts, logits, vocab)
    return { accepted, tokenId: next, draws: 0 }
  }
  for (let i = 0; i < drafts.length; i++) {
    const { ids, probs } = nucleus(logits, sampling, i * vocab, vocab)
    const x = drafts[i]!
    let px = 0
    for (let j = 0; j < ids.length; j++) if (ids[j] === x) { px = probs[j]!; break }
    if (rng() < px) continue
    // p without x, renormalised, by inverse CDF in the nucleus's order.
    const u = rng() * (1 - px)
    let acc = 0
    let last = -1
    for (let j = 0; j < ids.length; j++) {
      if (ids[j] === x) continue
      last = ids[j]!
      acc += probs[j]!
      if (u < acc) return { accepted: i, tokenId: last, draws: i + 2 }
    }
    return { accepted: i, tokenId: last < 0 ? x : last, draws: i + 2 }
  }
  const tokenId = pickToken(logits, { ...sampling, u: rng() }, drafts.length * vocab, vocab)
  return { accepted: drafts.length, tokenId, draws: drafts.length + 1 }
}
