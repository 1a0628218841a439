/**
 * A greedy speculative verify's outcome from the target's own choices: how many drafted tokens
 * stand and the target's token after them, from a verify step's logits rows or from each row's
 * greedy token (a graph's greedy_token). Pure; wherever a greedy verify is checked: the engine's
 * worker and runner (protocol.ts `verify`), daemon/speculative over a target that returns logits,
 * and daemon/pipeline's verify.ts.
 */
import { argmax } from './sampling.ts'

/**
 * Greedy acceptance of drafted tokens by id (speculative decoding): `logits` holds rows
 * [drafts.length + 1, vocab], row i the prediction after the context plus drafts[0..i). A draft
 * stands while it equals its row's argmax; `next` is the argmax after the accepted prefix (the
 * correction, or the bonus token when every draft stood). Here rather than in daemon/speculative
 * because the engine's worker checks a greedy verify step itself (protocol.ts `verify`).
 */
export function greedyVerdict (drafts: readonly number[], logits: Float32Array, vocab: number): { accepted: number, next: number } {
  let n = 0
  while (n < drafts.length && argmax(logits, n * vocab, vocab) === drafts[n]) n++
  return { accepted: n, next: argmax(logits, n * vocab, vocab) }
}

/** greedyVerdict from each row's greedy token (a graph's greedy_token): `best[i]` is row i's argmax. */
export function greedyVerdictOfTokens (drafts: readonly number[], best: readonly number[]): { accepted: number, next: number } {
  if (best.length !== drafts.length + 1) throw new RangeError(`${drafts.length} drafts need ${drafts.length + 1} greedy tokens, not ${best.length}`)
  let n = 0
  while (n < drafts.length && best[n] === drafts[n]) n++
  return { accepted: n, next: best[n]! }
}
