/**
 * Whether a request reuses a cached prefix, and how much of it: a pure decision.
 */

export interface ReuseInput {
  /** Tokens of the new prompt. */
  promptLength: number
  /** Tokens of the longest cached prefix the prompt starts with (0: none). */
  matchLength: number
  /** Below this many reusable tokens a copy is not worth its bookkeeping. */
  minReuseTokens: number
}

/**
 * Tokens to take from the cache (0: prefill everything). At most promptLength − 1: the prompt's
 * last position must still run, because its logits pick the first generated token and a cache
 * holds KV, not logits.
 */
export function decideReuse (r: ReuseInput): number {
  const reuse = Math.min(r.matchLength, r.promptLength - 1)
  return reuse >= Math.max(1, r.minReuseTokens) ? reuse : 0
}

/**
 * The default budget for kept prefixes when the operator gives none: an eighth of the memory free
 * at boot, at most 2 GiB and at least 64 MiB (a cache that cannot hold one long conversation is noise).
 */
export function defaultKvCacheBytes (freeBytes: number): number {
  const mib = 1024 * 1024
  return Math.max(64 * mib, Math.min(2048 * mib, Math.floor(freeBytes / 8 / mib) * mib))
}
