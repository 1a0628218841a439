/**
 * Which kept prefixes a chain may open from: the scope of a chain's KV. A prefix kept by a chain
 * is usable only by the same chain — the same peer for every stage with the same layer range, the
 * same weights and the same activation encoding (a lossy encoding changes every later stage's
 * KV) — because each stage holds its own layers' part of it. Scoped hashes (daemon/kv) keep one
 * chain's entries from ever answering for another's. A rebuilt chain reuses another chain's prefix
 * only by moving it: its changed stages pull their layers' part from the peers that kept it
 * (chainPulls).
 */
import { prefixScope } from '../kv/index.ts'
import type { ActivationEncoding } from './activations.ts'
import type { ChainHop, StagePull } from './wire.ts'

export function chainScope (manifestHash: string, chain: readonly ChainHop[], encoding: ActivationEncoding): string {
  const first = chain[0]?.layers[0] ?? 0
  const last = chain[chain.length - 1]?.layers[1] ?? 0
  const hops = chain.map(h => `${h.peerId}@${h.layers[0]}-${h.layers[1]}`).join(',')
  return `${prefixScope({ manifestHash, layers: [first, last], dtype: 'float32' })}/chain/${hops}/${encoding}`
}

/** The most finishes on one chain that skip keeping after refusals (see keepSkips). */
export const MAX_KEEP_SKIPS = 63

/**
 * How many of a chain's next finishes keep nothing after `refusals` refused prefixes in a row
 * (2^refusals − 1, at most MAX_KEEP_SKIPS): a stage that keeps nothing (no budget, an older
 * build) or evicts everything under pressure then costs a wasted open ever more rarely, while a
 * chain whose stages keep again is found again (a reuse resets the count).
 */
export function keepSkips (refusals: number): number {
  return Math.min(MAX_KEEP_SKIPS, 2 ** Math.min(Math.max(0, refusals), 16) - 1)
}

/**
 * The stages of `chain` that must pull their layers' part of a prefix `kept` (the chain that kept
 * it) holds, for `chain` to open from it: those whose peer changed. Undefined when `kept`'s KV
 * cannot serve `chain` — another stage 0 (the coordinator's own KV is not moved), another layer
 * split (a stage's KV is only its own layers'; with a lossy encoding even upstream splits change
 * it), or no stage changed (then it is the same chain, reused in place). The activation encoding
 * must match too; the caller compares the chains' scopes for that.
 */
export function chainPulls (kept: readonly ChainHop[], chain: readonly ChainHop[]): StagePull[] | undefined {
  if (kept.length !== chain.length || kept.length < 2 || kept[0]!.peerId !== chain[0]!.peerId) return undefined
  if (kept.some((h, i) => h.layers[0] !== chain[i]!.layers[0] || h.layers[1] !== chain[i]!.layers[1])) return undefined
  const pulls = kept.flatMap((h, hop) => hop > 0 && h.peerId !== chain[hop]!.peerId ? [{ hop, peerId: h.peerId }] : [])
  return pulls.length === 0 ? undefined : pulls
}
