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
  /**
   * Prompt positions that must still run (≥ 1; default DEFAULT_MIN_PREFILL_TOKENS). At least one:
   * the prompt's last position's logits pick the first generated token, and a cache holds KV, not
   * logits.
   */
  minPrefillTokens?: number
}

/**
 * At least two positions prefilled: onnxruntime's attention runs a one-position step through
 * another kernel (its decode path) than a longer one, and its logits differ in the last bits
 * (measured 1e-5 on fp32 and int4 graphs, and amplified by int8 activations into different greedy
 * tokens), while steps of two or more positions give bit-identical results however a prompt is
 * split. Prefilling two keeps a reused prompt's first token exactly the recomputed one.
 */
export const DEFAULT_MIN_PREFILL_TOKENS = 2

/** Tokens to take from the cache (0: prefill everything): the match, leaving minPrefillTokens to run. */
export function decideReuse (r: ReuseInput): number {
  const rest = Math.max(1, r.minPrefillTokens ?? DEFAULT_MIN_PREFILL_TOKENS)
  const reuse = Math.min(r.matchLength, r.promptLength - rest)
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
