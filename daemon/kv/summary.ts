/**
 * Reading another node's prefix summary (PrefixCache.summary): how many of a prompt's tokens it
 * probably holds. A lower bound up to the summary's sampling (at least half of what it shares)
 * and, with 64-bit hashes, almost never an overstatement; routing treats it as an estimate.
 */
import { compactHash } from './hash.ts'

/**
 * Several caches' summaries as one bounded list (a node with several models): taken round-robin,
 * so each keeps its most recent hashes, without duplicates.
 */
export function mergeSummaries (lists: ReadonlyArray<readonly string[]>, max: number): string[] {
  const out = new Set<string>()
  for (let i = 0; out.size < max && lists.some(l => i < l.length); i++) {
    for (const l of lists) {
      if (out.size >= max) break
      if (i < l.length) out.add(l[i]!)
    }
  }
  return [...out]
}

/**
 * Tokens of the prompt (whose chained block hashes, from blockHashes with the holder's scope, are
 * `promptHashes`) found in `summary`: the deepest listed block × blockSize, 0 when none is listed.
 */
export function cachedTokensFor (promptHashes: readonly string[], summary: ReadonlySet<string>, blockSize: number): number {
  for (let i = promptHashes.length - 1; i >= 0; i--) {
    if (summary.has(compactHash(promptHashes[i]!))) return (i + 1) * blockSize
  }
  return 0
}
