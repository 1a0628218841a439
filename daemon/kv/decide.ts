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

/** What a pull of a peer's prefix costs against prefilling the same tokens here. */
export interface PullCostInput {
  /** Prompt tokens the pull would save (beyond what this node already holds). */
  tokens: number
  /** KV bytes per token of this stage (2 × layers × kvHeads × headDim × 4 for float32). */
  bytesPerToken: number
  /** Measured (or assumed) throughput of the link to the holder. */
  linkBytesPerSecond: number
  /** Round trip to the holder. */
  rttMs: number
  /** Measured (or assumed) prefill speed of this node for this model. */
  prefillTokensPerSecond: number
  /**
   * Transfer must be this much cheaper than recomputation (default DEFAULT_PULL_MARGIN): a pull
   * also pays checksums, hashing, a copy into the engine and the risk of a refusal that ends in
   * recomputation anyway, none of which the two rates above see.
   */
  margin?: number
}

/** A pull must cost at most 1 / 1.25 of the recomputation it replaces. */
export const DEFAULT_PULL_MARGIN = 0.25
/**
 * Round trips a pull spends before its first byte of KV: the request and the holder's header
 * (the stream itself opens on the existing, admitted connection without a round trip of its own).
 */
export const PULL_ROUND_TRIPS = 1

/** The two sides of the comparison, in milliseconds (for logs and the benchmark). */
export function pullCost (i: PullCostInput): { transferMs: number, recomputeMs: number } {
  const transferMs = PULL_ROUND_TRIPS * Math.max(0, i.rttMs) + (i.tokens * i.bytesPerToken) / i.linkBytesPerSecond * 1000
  // Linear in the tokens: attention makes a long prefill cost more than this, so the estimate
  // leans towards recomputing (the cheap, always-correct side).
  const recomputeMs = i.tokens / i.prefillTokensPerSecond * 1000
  return { transferMs, recomputeMs }
}

/**
 * Whether to pull a prefix from its holder rather than prefill it here: only when the transfer
 * time, with its margin, is below the recomputation time. Unknown or nonsensical inputs (zero or
 * non-finite rates, no tokens) say no: recomputation is always correct.
 */
export function shouldPull (i: PullCostInput): boolean {
  const finite = [i.tokens, i.bytesPerToken, i.linkBytesPerSecond, i.rttMs, i.prefillTokensPerSecond].every(Number.isFinite)
  if (!finite || i.tokens <= 0 || i.bytesPerToken <= 0 || i.linkBytesPerSecond <= 0 || i.prefillTokensPerSecond <= 0) return false
  const { transferMs, recomputeMs } = pullCost(i)
  return transferMs * (1 + Math.max(0, i.margin ?? DEFAULT_PULL_MARGIN)) < recomputeMs
}

/** The least time a pull gets before it is given up for recomputation. */
export const MIN_PULL_WAIT_MS = 2_000
/** The longest timer a wait may use (setTimeout's and AbortSignal.timeout's bound). */
const MAX_WAIT_MS = 2 ** 31 - 1

/**
 * How long a pull may take before it is given up (and the prompt recomputed): twice the
 * recomputation it replaces, never under MIN_PULL_WAIT_MS (estimates are rough, timings noisy).
 * Whole milliseconds within a timer's range, as AbortSignal.timeout requires.
 */
export function pullWaitMs (i: PullCostInput): number {
  const ms = 2 * pullCost(i).recomputeMs
  return Number.isFinite(ms) ? Math.min(MAX_WAIT_MS, Math.max(MIN_PULL_WAIT_MS, Math.ceil(ms))) : MIN_PULL_WAIT_MS
}
