/**
 * Reading another node's prefix summary (PrefixCache.summary): how many of a prompt's tokens it
 * probably holds. A lower bound up to the summary's sampling (at least half of what it shares)
 * and, with 64-bit hashes, almost never an overstatement; routing treats it as an estimate.
 */
import { compactHash } from './hash.ts'

/**
 * A bounded summary of kept prefixes, each given as its chained block hashes (hex, blockHashes),
 * most recently used first: from each its deepest block and blocks 1, 2, 4, 8… deep (deepest
 * first), compacted, until `max`. A prompt sharing any prefix of an entry then matches a listed
 * block at least half as deep as what it shares (PrefixCache.summary; a chain coordinator's).
 */
export function summaryHashes (entries: Iterable<readonly string[]>, max: number): string[] {
  const out = new Set<string>()
  for (const hashes of entries) {
    const n = hashes.length
    if (n === 0) continue
    const depths = [n - 1]
    for (let d = 1; d < n; d *= 2) if (d - 1 !== n - 1) depths.push(d - 1)
    depths.sort((a, b) => b - a)
    for (const i of depths) {
      if (out.size >= max) break
      out.add(compactHash(hashes[i]!))
    }
    if (out.size >= max) break
  }
  return [...out]
}

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
