/**
 * Reading another node's prefix summary (PrefixCache.summary): how many of a prompt's tokens it
 * probably holds. A lower bound up to the summary's sampling (at least half of what it shares)
 * and, with 64-bit hashes, almost never an overstatement; routing treats it as an estimate.
 */
import { compactHash } from './hash.ts'

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
